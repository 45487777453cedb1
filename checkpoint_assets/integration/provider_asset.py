"""``provider_batch_asset``: a checkpointed asset whose rows go through a provider's batch API.

No ``from __future__ import annotations`` here: Dagster reads the run config's annotations.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import dagster as dg
from pydantic import Field

from checkpoint_assets.engine.calls.budget import Budget
from checkpoint_assets.engine.plan import function_fingerprint
from checkpoint_assets.engine.providers.provider_batches import ProviderJob, ProviderRun
from checkpoint_assets.engine.providers.submissions import BatchProvider
from checkpoint_assets.engine.settings import OnInputChange, Settings
from checkpoint_assets.integration.arguments import AssetArguments, SourceSpec
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


def provider_batch_asset(
    *,
    source: SourceSpec,
    id_column: str,
    parse: Callable[[dict[str, Any]], Mapping[str, Any]],
    provider: str = "openai",
    endpoint: str | None = None,
    wait: bool = True,
    poll_seconds: float = 30.0,
    max_poll_seconds: float = 600.0,
    input_columns: Sequence[str] | None = None,
    partitions_def: dg.PartitionsDefinition | None = None,
    retry_failed: bool = Settings.retry_failed,
    dedupe: bool = Settings.dedupe,
    max_failed_fraction: float = Settings.max_failed_fraction,
    max_attempts: int = Settings.max_attempts,
    on_input_change: OnInputChange | Literal["fail", "recompute"] = Settings.on_input_change,
    usage_columns: Sequence[str] = (),
    budget: Budget | None = None,
    name: str | None = None,
    key_prefix: str | Sequence[str] | None = None,
    group_name: str | None = None,
    code_version: str | None = None,
    pool: str | None = None,
    tags: Mapping[str, str] | None = None,
    description: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    io_manager_key: str = "io_manager",
    backfill_policy: dg.BackfillPolicy | None = None,
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

    Example::

        def parse(body: dict) -> dict:
            return {"route": body["choices"][0]["message"]["content"],
                    "prompt_tokens": body["usage"]["prompt_tokens"]}

        @provider_batch_asset(source="tickets", id_column="ticket_id", parse=parse,
                              provider="openai", partitions_def=shard_partitions(4))
        def ticket_routing(row: dict) -> dict:
            return {"messages": [{"role": "user", "content": row["body"]}]}

    The arguments it shares with :func:`checkpointed_asset` mean the same: ``source``,
    ``id_column``, ``input_columns``, ``partitions_def``, ``retry_failed``, ``dedupe``,
    ``max_failed_fraction``, ``on_input_change``, ``usage_columns`` and ``budget``. A budget
    prices results at the provider's batch discount, and sends no submission whose estimated cost
    would pass a limit. ``name``, ``key_prefix``, ``group_name``, ``code_version``, ``pool``,
    ``tags``, ``description``, ``metadata``, ``io_manager_key`` and ``backfill_policy`` go to
    ``dagster.asset``.

    Args:
        parse: The response body of one row -> its output columns (a dict, the same keys for
            every row). An exception makes that row failed with its text.
        max_attempts: Requests per row. A request that failed in a transient way (a server
            error, a rate limit, an expired batch) goes again in a new batch, within the run,
            until its row has had this many. An invalid request is a failed row at once.
        provider: The resource key of the provider's resource: ``OpenAIResource``,
            ``AnthropicResource``, or anything with ``batch_provider(endpoint)``.
        endpoint: The provider's API path of every request. OpenAI: ``/v1/chat/completions`` by
            default, ``/v1/embeddings``, ``/v1/responses``. Anthropic: ``/v1/messages`` only.
        wait: Wait for the batches in the run (True), or submit and end (False). Run config
            ``wait`` overrides it.
        poll_seconds: The first wait between polls of a waiting run, doubled after each poll.
        max_poll_seconds: The longest wait between polls.
    """
    if poll_seconds <= 0 or max_poll_seconds < poll_seconds:
        raise ValueError(
            f"poll_seconds must be positive and at most max_poll_seconds, got {poll_seconds} "
            f"and {max_poll_seconds}"
        )

    def decorator(request: Callable[[dict[str, Any]], dict[str, Any]]) -> dg.AssetsDefinition:
        def bind(context: dg.AssetExecutionContext, config: ProviderBatchRunConfig) -> ProviderJob:
            api = getattr(context.resources, provider).batch_provider(endpoint)
            if not isinstance(api, BatchProvider):
                raise TypeError(f"resource {provider!r}: batch_provider() is no BatchProvider")
            waits = wait if config.wait is None else config.wait
            return ProviderJob(api, request, parse, waits, poll_seconds, max_poll_seconds)

        code = function_fingerprint.of_function(request)
        parsed = sorted(function_fingerprint.of_function(parse).items())  # "the constant parse"
        code[function_fingerprint.CONSTANT + "parse"] = ",".join(f"{k}={v}" for k, v in parsed)
        calls = Calls((provider,), code, bind, ProviderRun, ProviderBatchRunConfig)
        arguments = AssetArguments(
            source=source,
            id_column=id_column,
            input_columns=input_columns,
            partitions_def=partitions_def,
            retry_failed=retry_failed,
            dedupe=dedupe,
            max_failed_fraction=max_failed_fraction,
            max_attempts=max_attempts,
            on_input_change=on_input_change,
            usage_columns=tuple(usage_columns),
            budget=budget,
            name=name,
            key_prefix=key_prefix,
            group_name=group_name,
            code_version=code_version,
            pool=pool,
            tags=tags,
            description=description,
            metadata=metadata,
            io_manager_key=io_manager_key,
            backfill_policy=backfill_policy,
        )
        return define(request, calls, arguments, kinds={"polars", "parquet", provider})

    return decorator
