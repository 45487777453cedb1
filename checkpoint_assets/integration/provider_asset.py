"""``provider_batch_asset``: a checkpointed asset whose rows go through a provider's batch API.

Its arguments are ``ProviderArguments``: those of every checkpointed asset (``CommonArguments``)
and the provider's, whose defaults are ``ProviderJob``'s.

No ``from __future__ import annotations`` here: Dagster reads the run config's annotations.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg
from pydantic import Field

from checkpoint_assets.engine.fields import required, setting
from checkpoint_assets.engine.plan import function_fingerprint
from checkpoint_assets.engine.providers.provider_batches import ProviderJob, ProviderRun
from checkpoint_assets.engine.providers.submissions import BatchProvider
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.arguments import CommonArguments, keyword_arguments_of
from checkpoint_assets.integration.asset import Calls, define
from checkpoint_assets.integration.run_config import CheckpointRunConfig


class ProviderBatchRunConfig(CheckpointRunConfig):
    """Run config of a provider batch asset: a checkpointed asset's, and whether to wait."""

    wait: bool | None = Field(
        default=None,
        description="Wait for the provider's batches and collect them in this run (true), or "
        "submit and end, leaving the partition to provider_batches_sensor (false); default: "
        "the asset's.",
    )
    recompute_unanswered: bool = Field(
        default=False,
        description="When parse changed: request again (paid) the finished rows that have no "
        "stored answer (keep_answers off, or stored without one). false: they keep their outputs.",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProviderArguments(CommonArguments):
    """Every keyword argument of ``provider_batch_asset``: those of every checkpointed asset,
    then the provider's."""

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
    wait: bool = setting(
        ProviderJob.wait,
        "Wait for the batches in the run (True), or submit and end (False). Run config wait "
        "overrides it.",
    )
    poll_seconds: float = setting(
        ProviderJob.poll_seconds,
        "The first wait between polls of a waiting run, doubled after each poll.",
    )
    max_poll_seconds: float = setting(
        ProviderJob.max_poll_seconds, "The longest wait between polls."
    )
    keep_answers: bool = setting(
        ProviderJob.keep_answers,
        "Store each row's response body (`_answer`), so a changed parse re-derives the outputs "
        "with no request. False stores none.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.poll_seconds <= 0 or self.max_poll_seconds < self.poll_seconds:
            raise ValueError(
                f"poll_seconds must be positive and at most max_poll_seconds, got "
                f"{self.poll_seconds} and {self.max_poll_seconds}"
            )


@keyword_arguments_of(ProviderArguments)
def provider_batch_asset(
    arguments: ProviderArguments,
) -> Callable[[Callable[[dict[str, Any]], dict[str, Any]]], dg.AssetsDefinition]:
    """Turn ``request(row) -> dict`` into a checkpointed asset computed by a provider's batch
    API (OpenAI's Batch API, Anthropic's Message Batches): about half the price of per-row
    calls, results within the provider's window (24 h) instead of at once.

    ``request`` gets one row (the id and the input columns) as a dict and returns the request
    body (the resource adds its ``model`` and request settings); ``parse`` gets the response body
    of that row and returns a dict of output columns, usage columns among them. The rows of each
    shard are submitted within the provider's limits and recorded in the shard's checkpoint before
    anything is sent, so no row is paid for twice whatever stops a run; results are stored like
    computed rows (resume, ``_error``, ``retry_failed``, usage metadata).

    With ``wait`` the run polls until every batch ended and materializes the partition; without
    it the run submits, records and fails with "Submitted, not materialized yet", and
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
    a = arguments
    provider = a.provider
    # The sensor reads the provider and endpoint from here (provider_batches_sensor).
    said = {md.PROVIDER: provider} | ({} if a.endpoint is None else {md.ENDPOINT: a.endpoint})
    declared = dataclasses.replace(a, metadata={**(a.metadata or {}), **said})

    def decorator(request: Callable[[dict[str, Any]], dict[str, Any]]) -> dg.AssetsDefinition:
        def bind(context: dg.AssetExecutionContext, config: ProviderBatchRunConfig) -> ProviderJob:
            api = getattr(context.resources, provider).batch_provider(a.endpoint)
            if not isinstance(api, BatchProvider):
                raise TypeError(f"resource {provider!r}: batch_provider() is no BatchProvider")
            waits = a.wait if config.wait is None else config.wait
            return ProviderJob(
                api,
                request,
                a.parse,
                waits,
                a.poll_seconds,
                a.max_poll_seconds,
                keep_answers=a.keep_answers,
                recompute_unanswered=config.recompute_unanswered,
            )

        # The request part, then the parse part (the resources add theirs to the request's).
        code = function_fingerprint.of_function(request) | function_fingerprint.of_parse(a.parse)
        calls = Calls((provider,), code, bind, ProviderRun, ProviderBatchRunConfig)
        return define(request, calls, declared, kinds={"polars", "parquet", provider})

    return decorator
