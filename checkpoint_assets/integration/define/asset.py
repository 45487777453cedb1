"""``checkpointed_asset``: a row-wise batch function as a resumable, sharded Dagster asset.

No ``from __future__ import annotations`` here: Dagster reads the body's annotations at runtime.
"""

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import dagster as dg
import polars as pl

from checkpoint_assets.engine.plan import function_fingerprint
from checkpoint_assets.engine.settings import Settings
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.define.arguments import (
    AssetArguments,
    CommonArguments,
    SourceSpec,
    keyword_arguments_of,
)
from checkpoint_assets.integration.define.function import Signature
from checkpoint_assets.integration.run import dry_run
from checkpoint_assets.integration.run.asset_run import AssetRun
from checkpoint_assets.integration.run.definition import Calls, Definition
from checkpoint_assets.integration.store.io_manager import declare_source
from checkpoint_assets.integration.store.source import as_lazy


@keyword_arguments_of(AssetArguments)
def checkpointed_asset(
    arguments: AssetArguments,
) -> Callable[[Callable[..., Any]], dg.AssetsDefinition]:
    """Turn ``fn(batch: pl.DataFrame) -> pl.DataFrame`` into a checkpointed Dagster asset.

    ``fn`` receives batches of ``batch_size`` rows (the id and the input columns). It returns the
    id and its output columns for those rows, in any order. It may be an ``async def``. Its
    other parameters are Dagster resources by name, and one named ``context`` gets the asset's
    execution context. Results are flushed to the checkpoint as Parquet parts every
    ``checkpoint_interval`` rows; an interrupted run resumes by id. Partitions from
    :func:`shard_partitions` split the input into shards that run in parallel.

    Raise :class:`RetryAfter` when the endpoint rate limits, or let an HTTP 429/503/529 from
    ``httpx``, ``openai`` or ``anthropic`` through. That call waits and is sent again. The
    shard's concurrency follows what the endpoint sustains.

    Every argument is keyword-only; they are the fields of ``AssetArguments`` (listed below).

    Example::

        @checkpointed_asset(source="tickets", id_column="ticket_id",
                            partitions_def=shard_partitions(4))
        def ticket_routing(batch: pl.DataFrame, llm: LLMResource) -> pl.DataFrame:
            return batch.select("ticket_id", route=pl.lit("billing"))
    """

    def decorator(fn: Callable[..., Any]) -> dg.AssetsDefinition:
        signature = Signature.of(fn, arguments.batch_size)
        calls = Calls(
            resources=signature.resources,
            code=function_fingerprint.of_function(fn),  # resources add theirs at run time
            bind=lambda context, config: signature.bind(fn, context),
        )
        return define(fn, calls, arguments)

    return decorator


def define(
    fn: Callable[..., Any], calls: Calls, a: CommonArguments, kinds: set[str] | None = None
) -> dg.AssetsDefinition:
    """The Dagster asset that runs ``calls`` over the shards of ``a.source`` (``fn``: its name
    and docstring)."""
    source_key = _source_key(a.source)
    declare_source(source_key, a.id_column)
    base = Settings(
        id_column=a.id_column, input_columns=tuple(a.input_columns or ()), **a.settings()
    )
    run = Definition(calls, base, source_key, a.io_manager_key, a.code_version, a.reuse)

    def body(
        context: dg.AssetExecutionContext, config: Any, source: Any
    ) -> Iterator[dg.Output[pl.DataFrame]]:
        shards = AssetRun.of(context, config, as_lazy(source), run)
        if config.dry_run:
            dry_run.report(context, shards.estimate())
            return  # no output: nothing materializes (see dry_run.py)
        result = shards.materialize()
        if result is not None:  # None: a ranged run recorded each shard as it ended
            yield dg.Output(result)

    body.__annotations__["config"] = calls.config  # Dagster reads the run config's class here
    body.__doc__ = fn.__doc__
    asset: dg.AssetsDefinition = dg.asset(**_asset_options(fn, calls, a, source_key, kinds))(body)
    return asset


_RESULT = dg.PythonObjectDagsterType(pl.DataFrame)


def _asset_options(
    fn: Callable[..., Any],
    calls: Calls,
    a: CommonArguments,
    source_key: dg.AssetKey,
    kinds: set[str] | None,
) -> dict[str, Any]:
    """The arguments of ``dg.asset`` for the asset ``define`` builds."""
    return {
        "name": a.name or fn.__name__,
        "key_prefix": a.key_prefix,
        # The IO manager gives a source marked with the id column as a lazy scan.
        "ins": {
            "source": dg.AssetIn(
                key=source_key,
                metadata={md.ID_COLUMN: a.id_column},
                partition_mapping=a.source_partition_mapping,
            )
        },
        "partitions_def": a.partitions_def,
        "group_name": a.group_name,
        "code_version": a.code_version,
        "pool": a.pool,
        "tags": dict(a.tags) if a.tags else None,
        "description": a.description or inspect.getdoc(fn),
        "metadata": {
            **(a.metadata or {}),
            md.ID_COLUMN: a.id_column,
            md.SOURCE: source_key.to_user_string(),
            md.RETRY_FAILED: a.retry_failed,
        },
        "io_manager_key": a.io_manager_key,
        "output_required": False,  # a dry run yields no output
        "dagster_type": _RESULT,  # what a generator's annotation does not say
        "required_resource_keys": set(calls.resources) or None,
        "backfill_policy": a.backfill_policy,
        "kinds": {*(kinds or {"polars", "parquet"}), *(a.kinds or ())},
        "owners": list(a.owners) if a.owners else None,
        "op_tags": dict(a.op_tags) if a.op_tags else None,
        "retry_policy": a.retry_policy,
        "automation_condition": a.automation_condition,
    }


def _source_key(source: SourceSpec) -> dg.AssetKey:
    if isinstance(source, dg.AssetsDefinition):
        return source.key
    if isinstance(source, dg.AssetKey):
        return source
    if isinstance(source, str):
        return dg.AssetKey.from_user_string(source)
    return dg.AssetKey(list(source))
