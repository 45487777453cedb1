"""``provider_batch_asset``: the request/parse asset, whose rows go to a model provider online,
through its batch API, or both (``mode``).

Its arguments are ``ProviderArguments``: those of every checkpointed asset (``CommonArguments``),
how online calls are made (``AssetSettings``) and the provider's, whose defaults are
``ProviderJob``'s. ``mode``, ``deadline`` and ``wait`` take their defaults, meanings and rules
from ``Way`` (``engine/providers/job.py``), and so does the run config that overrides them.

No ``from __future__ import annotations`` here: Dagster reads the run config's annotations.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg
from pydantic import Field, model_validator

from checkpoint_assets.engine.fields import doc_of, required, setting
from checkpoint_assets.engine.loop.shard_run import OwnLoop
from checkpoint_assets.engine.plan import function_fingerprint
from checkpoint_assets.engine.providers.job import Mode, ProviderJob, Way
from checkpoint_assets.engine.providers.provider_batches import provider_loop
from checkpoint_assets.engine.providers.submissions import BatchProvider
from checkpoint_assets.engine.settings import AssetSettings
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.define.arguments import CommonArguments, keyword_arguments_of
from checkpoint_assets.integration.define.asset import define
from checkpoint_assets.integration.run.definition import Calls
from checkpoint_assets.integration.run.run_config import CheckpointRunConfig

_LEFT_OUT = "Left out: the asset's."


def _overridden(name: str) -> str:
    """The meaning of ``Way``'s field ``name`` as an argument of the asset."""
    return f"{doc_of(Way, name)} Run config overrides it."


class ProviderBatchRunConfig(CheckpointRunConfig):
    """Run config of a request/parse asset: a checkpointed asset's, how to run it (``mode``,
    ``deadline``) and whether to wait."""

    wait: bool | None = Field(default=None, description=f"{doc_of(Way, 'wait')} {_LEFT_OUT}")
    recompute_unanswered: bool = Field(
        default=False,
        description="When parse changed: request again (paid) the finished rows that have no "
        "stored answer (keep_answers off, or stored without one). false: they keep their outputs.",
    )
    mode: str | None = Field(default=None, description=f"{doc_of(Way, 'mode')} {_LEFT_OUT}")
    deadline: Any = Field(
        default=None, description=f"{doc_of(Way, 'deadline_seconds')} {_LEFT_OUT}"
    )

    @model_validator(mode="after")
    def _way(self) -> "ProviderBatchRunConfig":
        # What the run config says alone, checked when the step starts, before anything is read
        # or sent; over the asset's way in _job.
        Way.of(self.mode, self.deadline, self.wait)
        return self


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProviderArguments(CommonArguments, AssetSettings):
    """Every keyword argument of ``provider_batch_asset``: those of every checkpointed asset,
    how online calls are made, then the provider's."""

    parse: Callable[[dict[str, Any]], Mapping[str, Any]] = required(
        "The response body of one row -> its output columns (a dict, the same keys for every "
        "row). An exception makes that row failed with its text."
    )
    provider: str = setting(
        "openai",
        "The resource key of the provider's resource: OpenAIResource, AnthropicResource, or "
        "anything with batch_provider(endpoint).",
    )
    endpoint: str | None = setting(
        None,
        "The provider's API path of every request. OpenAI: /v1/chat/completions by default, "
        "/v1/embeddings, /v1/responses. Anthropic: /v1/messages only.",
    )
    wait: bool = setting(Way.wait, _overridden("wait"))
    poll_seconds: float = setting(
        ProviderJob.poll_seconds,
        "The first wait between polls of a waiting run, doubled after each poll.",
    )
    max_poll_seconds: float = setting(
        ProviderJob.max_poll_seconds, "The longest wait between polls."
    )
    mode: str = setting(Way.mode.value, _overridden("mode"))
    deadline: float | str | None = setting(Way.deadline_seconds, _overridden("deadline_seconds"))
    keep_answers: bool = setting(
        ProviderJob.keep_answers,
        "Store each row's response body (`_answer`), so a changed parse re-derives the outputs "
        "with no request. False stores none.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _ = self.way  # mode, deadline and wait are checked by Way.of
        if self.batch_size not in (None, 1):
            raise ValueError(
                f"batch_size={self.batch_size}, but a request/parse asset sends one row per "
                "request: leave batch_size unset."
            )
        if self.poll_seconds <= 0 or self.max_poll_seconds < self.poll_seconds:
            raise ValueError(
                f"poll_seconds must be positive and at most max_poll_seconds, got "
                f"{self.poll_seconds} and {self.max_poll_seconds}"
            )

    @property
    def way(self) -> Way:
        """The asset's mode, deadline and waiting, which run config overrides."""
        return Way.of(self.mode, self.deadline, self.wait)


@keyword_arguments_of(ProviderArguments)
def provider_batch_asset(
    arguments: ProviderArguments,
) -> Callable[[Callable[[dict[str, Any]], dict[str, Any]]], dg.AssetsDefinition]:
    """Turn ``request(row) -> dict`` into the request/parse asset.

    It is a checkpointed asset whose rows go to a model provider, in any ``mode``:

    - ``batch`` (the default) uses the provider's batch API (OpenAI's Batch API, Anthropic's
      Message Batches). It costs about half the price of per-row calls. Results come within the
      provider's window (24 h), not at once.
    - ``online`` sends each row's request at once through the resource (its pacing,
      ``max_concurrency``).
    - ``hybrid`` submits batches and finishes online what the ``deadline``, an expiry or a
      failure left.

    Run config ``mode`` and ``deadline`` choose per run; no row is paid twice.

    ``request`` gets one row (the id and the input columns) as a dict and returns the request
    body. The resource adds its ``model`` and request settings. ``parse`` gets the response body
    of that row and returns a dict of output columns, usage columns among them.

    The rows of each shard are submitted within the provider's limits. They are recorded in the
    shard's checkpoint before anything is sent, so no row is paid for twice whatever stops a run.
    Results are stored like computed rows (resume, ``_error``, ``retry_failed``, usage
    metadata). Each keeps its response body in ``_answer``.

    With ``wait``, the run polls until every batch ended and materializes the partition. Without
    it, the run submits, records and fails with "Submitted, not materialized yet". Then
    :func:`provider_batches_sensor` requests the run that collects the results once they end.

    The arguments it shares with :func:`checkpointed_asset` mean the same. A ``budget`` prices
    results at the provider's batch discount, and sends no submission whose estimated cost would
    pass a limit. Every argument is keyword-only; they are the fields of ``ProviderArguments``
    (listed below).

    Example::

        def parse(body: dict) -> dict:
            return {"route": body["choices"][0]["message"]["content"],
                    "prompt_tokens": body["usage"]["prompt_tokens"]}

        @provider_batch_asset(source="tickets", id_column="ticket_id", parse=parse,
                              provider="openai", partitions_def=shard_partitions(4))
        def ticket_routing(row: dict) -> dict:
            return {"messages": [{"role": "user", "content": row["body"]}]}
    """
    a, provider = arguments, arguments.provider
    # The sensor reads the provider and endpoint from here (provider_batches_sensor).
    said = {md.PROVIDER: provider} | ({} if a.endpoint is None else {md.ENDPOINT: a.endpoint})
    declared = dataclasses.replace(a, metadata={**(a.metadata or {}), **said})

    def decorator(request: Callable[[dict[str, Any]], dict[str, Any]]) -> dg.AssetsDefinition:
        # The request part, then the parse part (the resources add theirs to the request's).
        code = function_fingerprint.of_function(request) | function_fingerprint.of_parse(a.parse)
        parse = a.parse if a.keep_answers else None  # reads the answers of rows reused

        def bind(context: dg.AssetExecutionContext, config: ProviderBatchRunConfig) -> OwnLoop:
            return provider_loop(_job(a, request, context, config))

        calls = Calls((provider,), code, bind, ProviderBatchRunConfig, request, parse)
        return define(request, calls, declared, kinds={"polars", "parquet", provider})

    return decorator


def _job(
    a: ProviderArguments,
    request: Callable[[dict[str, Any]], dict[str, Any]],
    context: dg.AssetExecutionContext,
    config: ProviderBatchRunConfig,
) -> ProviderJob:
    """The job of one run: the provider's adapter and sender from its resource, with the asset's
    arguments and the run config."""
    provider = a.provider
    resource = getattr(context.resources, provider)
    api = resource.batch_provider(a.endpoint)
    if not isinstance(api, BatchProvider):
        raise TypeError(f"resource {provider!r}: batch_provider() is no BatchProvider")
    way = Way.of(config.mode, config.deadline, config.wait, over=a.way)
    mode = way.mode
    send = None
    if mode is not Mode.batch:
        if not hasattr(resource, "sender"):
            raise TypeError(
                f"mode {mode.value} sends rows online, but resource {provider!r} has no "
                "sender(endpoint): use OpenAIResource or AnthropicResource, or mode batch."
            )
        send = resource.sender(a.endpoint)
    return ProviderJob(
        api,
        request,
        a.parse,
        way,
        a.poll_seconds,
        a.max_poll_seconds,
        send=send,
        keep_answers=a.keep_answers,
        recompute_unanswered=config.recompute_unanswered,
    )
