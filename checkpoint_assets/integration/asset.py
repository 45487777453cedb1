"""``checkpointed_asset``: a row-wise batch function as a resumable, sharded Dagster asset.

No ``from __future__ import annotations`` here: Dagster reads the body's annotations at runtime.
"""

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import dagster as dg
import polars as pl
from pydantic import Field, model_validator

from checkpoint_assets.engine import function_fingerprint, hashing, runner
from checkpoint_assets.engine.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import CheckpointError, TooManyFailuresError
from checkpoint_assets.engine.global_resume import JOB, shard_rows
from checkpoint_assets.engine.layout import DEFAULT_TAG, asset_folder
from checkpoint_assets.engine.scheme import Scheme, Shard, rows_in
from checkpoint_assets.engine.settings import OnInputChange, RunStats, Settings
from checkpoint_assets.engine.storage import Store
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.advice import advise
from checkpoint_assets.integration.function import Signature
from checkpoint_assets.integration.global_resume import global_resume_key, table_path
from checkpoint_assets.integration.io_manager import CheckpointIOManager, checkpoint_io_manager
from checkpoint_assets.integration.source import (
    ShardRows,
    as_lazy,
    scan,
    user_columns,
    without_shard_keys,
)

SourceSpec = str | dg.AssetKey | dg.AssetsDefinition | Sequence[str]
T = TypeVar("T")
JOB_FORMAT = 1


class CheckpointRunConfig(dg.Config):
    """Run config of a checkpointed asset (UI launchpad, ``--config-json``)."""

    resume: bool = Field(
        default=True,
        description="Skip rows the checkpoint holds. false: recompute all (still checkpointing).",
    )
    checkpointing: bool = Field(
        default=True,
        description="Write a checkpoint. false: compute in memory, write nothing, resume nothing.",
    )
    checkpoint_tag: str | None = Field(
        default=None, description="Name of the checkpoint, to keep separate runs apart."
    )
    checkpoint_interval: int | None = Field(
        default=None, ge=1, description="Rows per flush, at least 1 (overrides the asset's)."
    )
    batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Rows per call, at least 1 (overrides the asset's; default: the checkpoint "
        "interval).",
    )
    global_resume: bool = Field(
        default=False,
        description="Take finished rows from every checkpoint of the asset (after a reshard).",
    )
    limit: int | None = Field(
        default=None, ge=0, description="Process only the first N rows of the shard (a smoke run)."
    )
    retry_failed: bool | None = Field(
        default=None, description="Compute rows stored as failed again (default: the asset's)."
    )
    on_input_change: OnInputChange | None = Field(
        default=None,
        description="fail or recompute finished rows whose input changed (default: the asset's).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "CheckpointRunConfig":
        # Checked when the step starts, before the source is read or anything is computed.
        if self.global_resume and not self.resume:
            raise ValueError(
                "global_resume: true takes finished rows from other checkpoints, but resume: "
                "false computes every row again, so they cannot both hold. Drop global_resume to "
                "recompute everything, or drop resume: false to take the finished rows."
            )
        return self


def checkpointed_asset(
    *,
    source: SourceSpec,
    id_column: str,
    input_columns: Sequence[str] | None = None,
    partitions_def: dg.PartitionsDefinition | None = None,
    source_partition_mapping: dg.PartitionMapping | None = None,
    checkpoint_interval: int = Settings.checkpoint_interval,
    batch_size: int | None = Settings.batch_size,
    flush_seconds: float = Settings.flush_seconds,
    min_flush_seconds: float | None = Settings.min_flush_seconds,
    retry_failed: bool = Settings.retry_failed,
    dedupe: bool = Settings.dedupe,
    max_failed_fraction: float = Settings.max_failed_fraction,
    on_input_change: OnInputChange | Literal["fail", "recompute"] = Settings.on_input_change,
    max_concurrency: int = Settings.max_concurrency,
    min_concurrency: int = Settings.min_concurrency,
    adaptive_concurrency: bool = Settings.adaptive_concurrency,
    max_attempts: int = Settings.max_attempts,
    retry_delay_seconds: float = Settings.retry_delay_seconds,
    max_throttle_seconds: float = Settings.max_throttle_seconds,
    usage_columns: Sequence[str] = (),
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
) -> Callable[[Callable[..., Any]], dg.AssetsDefinition]:
    """Turn ``fn(batch: pl.DataFrame) -> pl.DataFrame`` into a checkpointed Dagster asset.

    ``fn`` receives batches of ``batch_size`` rows (the id and the input columns) and returns the
    id and its output columns for those rows, in any order; it may be an ``async def``. Its
    other parameters are Dagster resources by name, and one named ``context`` gets the asset's
    execution context. Results are flushed to the checkpoint as Parquet parts every
    ``checkpoint_interval`` rows; an interrupted run resumes by id. Partitions from
    :func:`shard_partitions` split the input into shards that run in parallel.

    Raise :class:`RetryAfter` (or let an HTTP 429/503/529 from ``httpx``, ``openai`` or
    ``anthropic`` through) when the endpoint rate limits: that call waits and is sent again, and
    the shard's concurrency follows what the endpoint sustains.

    Example::

        @checkpointed_asset(source="tickets", id_column="ticket_id",
                            partitions_def=shard_partitions(4))
        def ticket_routing(batch: pl.DataFrame, llm: LLMResource) -> pl.DataFrame:
            return batch.select("ticket_id", route=pl.lit("billing"))

    Args:
        source: the upstream asset with the rows.
        id_column: unique integer or string id of each row.
        input_columns: the columns ``fn`` reads and that fingerprint a row (default: all).
        source_partition_mapping: which partitions of a partitioned source each partition
            reads, e.g. ``dagster.AllPartitionMapping()`` for shards over every partition of
            a source written a file or a day at a time (default: Dagster's own rule).
        checkpoint_interval: rows per flush (parts are written every this many rows).
        batch_size: rows per call (default: ``checkpoint_interval``). One-row calls to a remote
            model want ``batch_size=1`` with a larger ``checkpoint_interval``.
        flush_seconds: flush at least this often while rows are done.
        min_flush_seconds: never flush more often than this (default 0 locally, 5 s on object
            stores, where each flush costs requests).
        retry_failed: compute rows stored as failed again on the next run.
        dedupe: call ``fn`` once per distinct input; copies share its result.
        max_failed_fraction: above this fraction of failed rows the run fails (after
            checkpointing everything else).
        on_input_change: "fail" or "recompute" finished rows whose input changed.
        max_concurrency: batches in flight at once (threads, or asyncio for ``async def``).
        min_concurrency: the fewest batches in flight that rate limits may bring it down to.
        adaptive_concurrency: follow what the endpoint sustains between the two (False: keep
            ``max_concurrency``, for an endpoint whose limit is known).
        max_attempts: calls of a failing batch before it is split to isolate poison rows.
        retry_delay_seconds: first delay between attempts, doubled each time (also the first
            back-off of a rate limit that does not say how long to wait).
        max_throttle_seconds: stop with :class:`QuotaExhaustedError` after being rate limited
            this long without a single successful call.
        usage_columns: numeric output columns (tokens, cost) summed into the metadata as
            ``usage/<col>`` (this run) and ``usage_total/<col>`` (every stored row).
        name, key_prefix, group_name, code_version, pool, tags, description, metadata,
        io_manager_key, backfill_policy: passed on to ``dagster.asset``.
    """
    source_key = _source_key(source)

    def decorator(fn: Callable[..., Any]) -> dg.AssetsDefinition:
        asset_name = name or fn.__name__
        signature = Signature.of(fn, batch_size)
        code = function_fingerprint.of_function(fn)  # resources add theirs at run time
        base = Settings(
            id_column=id_column,
            input_columns=tuple(input_columns or ()),
            checkpoint_interval=checkpoint_interval,
            batch_size=batch_size,
            max_throttle_seconds=max_throttle_seconds,
            usage_columns=tuple(usage_columns),
            flush_seconds=flush_seconds,
            min_flush_seconds=min_flush_seconds,
            retry_failed=retry_failed,
            on_input_change=OnInputChange(on_input_change),
            dedupe=dedupe,
            max_failed_fraction=max_failed_fraction,
            max_concurrency=max_concurrency,
            min_concurrency=min_concurrency,
            adaptive_concurrency=adaptive_concurrency,
            max_attempts=max_attempts,
            retry_delay_seconds=retry_delay_seconds,
        )
        definition_metadata = {
            **(metadata or {}),
            md.ID_COLUMN: id_column,
            md.SOURCE: source_key.to_user_string(),
            md.RETRY_FAILED: retry_failed,
        }

        def body(
            context: dg.AssetExecutionContext, config: CheckpointRunConfig, source: Any
        ) -> pl.DataFrame:
            io_manager = checkpoint_io_manager(context, io_manager_key)
            keys = (
                list(context.partition_keys)
                if context.has_partition_key_range or context.has_partition_key
                else [None]
            )
            table = as_lazy(source)
            call = signature.bind(fn, context)
            store = io_manager.store()
            settings = _settings(base, config, user_columns(table.collect_schema().names()))
            resources = {r: getattr(context.resources, r) for r in signature.resources}
            printed = {**code, **function_fingerprint.of_resources(resources)}
            job = {
                "format": JOB_FORMAT,
                "asset": context.asset_key.to_user_string(),
                "code_version": code_version,
                "id_column": settings.id_column,
                "input_columns": list(settings.input_columns),
            }
            imported = None  # read once for every shard of a ranged run
            if config.global_resume:
                tag = config.checkpoint_tag
                imported = _global_rows(io_manager, store, context, job, keys, tag)
            # Only these shards' rows, streamed; one shard's rows in memory at a time.
            with ShardRows(table, id_column, keys) as shard_rows:
                frames: list[pl.DataFrame] = []
                stats: list[RunStats] = []
                too_many: list[TooManyFailuresError] = []
                for key in keys:
                    checkpoint = io_manager.checkpoint(
                        context.asset_key, config.checkpoint_tag, key, store
                    )
                    saved = md.saved_on_failure(
                        context, checkpoint, key, settings.id_column, config.checkpointing
                    )
                    try:
                        with saved:  # on a failure or interrupt: say what the checkpoint holds
                            frame, one = _run_partition(
                                context,
                                config,
                                call,
                                settings,
                                checkpoint,
                                shard_rows.of(key),  # one shard's rows held at a time
                                key,
                                job,
                                imported,
                                printed,
                            )
                    except TooManyFailuresError as e:
                        # A ranged run still finishes its other shards, so their retries are free.
                        too_many.append(e)
                        continue
                    except CheckpointError as e:
                        raise advise(e) from None
                    frames.append(frame)
                    stats.append(one)
            if too_many:
                raise advise(TooManyFailuresError.of_several(too_many))
            result = frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed")
            context.add_output_metadata(
                md.materialization(
                    stats,
                    config.checkpoint_tag or DEFAULT_TAG,
                    config.checkpointing,
                    result,
                    settings.id_column,
                )
            )
            return result

        body.__doc__ = fn.__doc__
        return dg.asset(
            name=asset_name,
            key_prefix=key_prefix,
            # The IO manager gives a source marked with the id column as a lazy scan.
            ins={
                "source": dg.AssetIn(
                    key=source_key,
                    metadata={md.ID_COLUMN: id_column},
                    partition_mapping=source_partition_mapping,
                )
            },
            partitions_def=partitions_def,
            group_name=group_name,
            code_version=code_version,
            pool=pool,
            tags=dict(tags) if tags else None,
            description=description or inspect.getdoc(fn),
            metadata=definition_metadata,
            io_manager_key=io_manager_key,
            required_resource_keys=set(signature.resources) or None,
            backfill_policy=backfill_policy,
            kinds={"polars", "parquet"},
        )(body)

    return decorator


def _settings(base: Settings, config: CheckpointRunConfig, columns: Sequence[str]) -> Settings:
    """The engine settings of this run: the decorator's, with the run config applied."""
    return dataclasses.replace(
        base,
        input_columns=base.input_columns or tuple(c for c in columns if c != base.id_column),
        checkpoint_interval=_given(config.checkpoint_interval, base.checkpoint_interval),
        batch_size=_given(config.batch_size, base.batch_size),
        resume=config.resume,
        checkpointing=config.checkpointing,
        retry_failed=_given(config.retry_failed, base.retry_failed),
        on_input_change=_given(config.on_input_change, base.on_input_change),
    )


def _given(value: T | None, asset_value: T) -> T:
    """The run config's value when it gives one (0 and false included), else the asset's."""
    return asset_value if value is None else value


def _run_partition(
    context: dg.AssetExecutionContext,
    config: CheckpointRunConfig,
    fn: Callable[..., Any],
    settings: Settings,
    checkpoint: Checkpoint,
    source: pl.DataFrame,
    partition: str | None,
    job: dict[str, Any],
    imported: pl.DataFrame | None,
    printed: dict[str, str],
) -> tuple[pl.DataFrame, RunStats]:
    """Run one partition's checkpoint over its input rows; returns its result and stats."""
    if config.limit is not None:
        source = source.head(config.limit)
    inputs = runner.prepare(source, settings)
    instance = context.instance

    def is_run_finished(run_id: str) -> bool:
        record = instance.get_run_by_id(run_id)
        return record is not None and record.is_finished

    label = context.asset_key.to_user_string() + (f" {partition}" if partition else "")
    return runner.run(
        fn,
        inputs,
        checkpoint,
        settings,
        job=job,
        scheme=Scheme.of(partition),
        run_id=context.run.run_id,
        is_run_finished=is_run_finished,
        logger=context.log,  # type: ignore[arg-type]
        label=label,
        imported=imported,
        function_fingerprint=printed,
    )


def _global_rows(
    io_manager: CheckpointIOManager,
    store: Store,
    context: dg.AssetExecutionContext,
    job: dict[str, Any],
    keys: Sequence[str | None],
    tag: str | None,
) -> pl.DataFrame:
    """Finished rows of this job from other checkpoints, for the shards ``keys``.

    Range shards read only the overlapping checkpoints of earlier shard counts; when storage
    holds checkpoints that cannot be narrowed down (unpartitioned, other partition keys, the mod
    rule), the rows come from the asset's global resume table of the run's tag.
    """
    asset_key = context.asset_key
    fingerprint = hashing.job_fingerprint(job)
    shards = [Shard.parse(k) for k in keys if k is not None]
    if shards and len(shards) == len(keys) and all(shards):
        folder = asset_folder(asset_key.path, tag or DEFAULT_TAG)
        ranged = [s for s in shards if s is not None]
        found = shard_rows(store, folder, job["id_column"], fingerprint, ranged)
        if found is not None:
            table, read = found
            context.log.info(
                "Global resume: %d finished row(s) of these shards in %d overlapping "
                "checkpoint(s) of earlier shard counts (%s).",
                table.height,
                len(read.checkpoints),
                ", ".join(sorted(set(read.schemes))) or "none found",
            )
            return table
    key = global_resume_key(asset_key)
    path = table_path(io_manager, store, asset_key, tag)  # this tag's: tags never mix
    if not store.fs.exists(path):
        raise CheckpointError(
            f"`global_resume: true` needs the table of {key.to_user_string()} for checkpoint "
            f"tag {tag or DEFAULT_TAG!r} at {store.display(path)}, which does not exist (storage "
            "holds checkpoints that are not range shards: unpartitioned, other partition keys, "
            "or shards written by the earlier mod rule).",
            f"Add global_resume_asset({asset_key.path[-1]}) to your Definitions and materialize "
            "it first (it builds a table for every tag on storage).",
        )
    stored = scan(store, path)
    if JOB not in stored.collect_schema():
        return pl.DataFrame()  # no finished rows anywhere
    # Stored in the keyed layout: the shards' filter reads only their row groups.
    mine = rows_in(stored, job["id_column"], keys).filter(pl.col(JOB) == fingerprint).drop(JOB)
    return without_shard_keys(mine).collect(engine="streaming")


def _source_key(source: SourceSpec) -> dg.AssetKey:
    if isinstance(source, dg.AssetsDefinition):
        return source.key
    if isinstance(source, dg.AssetKey):
        return source
    if isinstance(source, str):
        return dg.AssetKey.from_user_string(source)
    return dg.AssetKey(list(source))
