"""``checkpointed_asset``: a row-wise batch function as a resumable, sharded Dagster asset.

No ``from __future__ import annotations`` here: Dagster reads the body's annotations at runtime.
"""

import dataclasses
import enum
import inspect
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import dagster as dg
import numpy as np
import polars as pl
import pyarrow as pa
from pydantic import Field

from checkpoint_assets.engine import hashing, runner
from checkpoint_assets.engine.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import CheckpointError, TooManyFailuresError
from checkpoint_assets.engine.reconcile import JOB
from checkpoint_assets.engine.runner import RunStats, Settings
from checkpoint_assets.engine.storage import ObjectStore, Store
from checkpoint_assets.integration.global_resume import global_resume_key
from checkpoint_assets.integration.io_manager import (
    DEFAULT_TAG,
    ID_COLUMN_KEY,
    CheckpointIOManager,
    checkpoint_io_manager,
)
from checkpoint_assets.integration.partitions import parse_shard

SourceSpec = str | dg.AssetKey | dg.AssetsDefinition | Sequence[str]
# Object stores charge per request: flushes there wait at least this long since the previous one.
DEFAULT_MIN_FLUSH_SECONDS_OBJECT_STORE = 5.0
JOB_FORMAT = 1
# Definition metadata read by the sensor and the asset checks.
SOURCE_KEY = "checkpoint_assets/source"
RETRY_FAILED_KEY = "checkpoint_assets/retry_failed"


class InputChange(enum.Enum):
    """What to do with finished rows whose input changed."""

    fail = "fail"
    recompute = "recompute"


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
        default=None, description="Rows per flush and per call (overrides the asset's)."
    )
    global_resume: bool = Field(
        default=False,
        description="Take finished rows from every checkpoint of the asset (after a reshard).",
    )
    limit: int | None = Field(
        default=None, description="Process only the first N rows of the shard (a smoke run)."
    )
    retry_failed: bool | None = Field(
        default=None, description="Compute rows stored as failed again (default: the asset's)."
    )
    on_input_change: InputChange | None = Field(
        default=None,
        description="fail or recompute finished rows whose input changed (default: the asset's).",
    )


def checkpointed_asset(
    *,
    source: SourceSpec,
    id_column: str,
    input_columns: Sequence[str] | None = None,
    partitions_def: dg.PartitionsDefinition | None = None,
    checkpoint_interval: int = 16,
    flush_seconds: float = 30.0,
    min_flush_seconds: float | None = None,
    retry_failed: bool = True,
    dedupe: bool = False,
    max_failed_fraction: float = 0.0,
    on_input_change: Literal["fail", "recompute"] = "fail",
    max_concurrency: int = 1,
    max_attempts: int = 3,
    retry_delay_seconds: float = 1.0,
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

    ``fn`` receives batches of ``checkpoint_interval`` rows (the id and the input columns) and
    returns the id and its output columns for those rows, in any order. Results are flushed to
    the checkpoint as Parquet parts; an interrupted run resumes by id. Partitions from
    :func:`shard_partitions` split the input into shards that run in parallel.

    Example::

        @checkpointed_asset(source="tickets", id_column="ticket_id",
                            partitions_def=shard_partitions(4))
        def ticket_routing(batch: pl.DataFrame) -> pl.DataFrame:
            return batch.select("ticket_id", route=pl.lit("billing"))

    Args:
        source: the upstream asset with the rows.
        id_column: unique integer or string id of each row.
        input_columns: the columns ``fn`` reads and that fingerprint a row (default: all).
        checkpoint_interval: rows per call and per flush.
        flush_seconds: flush at least this often while rows are done.
        min_flush_seconds: never flush more often than this (default 0 locally, 5 s on object
            stores, where each flush costs requests).
        retry_failed: compute rows stored as failed again on the next run.
        dedupe: call ``fn`` once per distinct input; copies share its result.
        max_failed_fraction: above this fraction of failed rows the run fails (after
            checkpointing everything else).
        on_input_change: "fail" or "recompute" finished rows whose input changed.
        max_concurrency: batches in flight at once (threads, or asyncio for ``async def``).
        max_attempts: calls of a failing batch before it is split to isolate poison rows.
        retry_delay_seconds: first delay between attempts, doubled each time.
        name, key_prefix, group_name, code_version, pool, tags, description, metadata,
        io_manager_key, backfill_policy: passed on to ``dagster.asset``.
    """
    source_key = _source_key(source)

    def decorator(fn: Callable[..., Any]) -> dg.AssetsDefinition:
        asset_name = name or fn.__name__
        base = Settings(
            id_column=id_column,
            input_columns=tuple(input_columns or ()),
            checkpoint_interval=checkpoint_interval,
            flush_seconds=flush_seconds,
            min_flush_seconds=min_flush_seconds or 0.0,
            retry_failed=retry_failed,
            on_input_change=on_input_change,
            dedupe=dedupe,
            max_failed_fraction=max_failed_fraction,
            max_concurrency=max_concurrency,
            max_attempts=max_attempts,
            retry_delay_seconds=retry_delay_seconds,
        )
        definition_metadata = {
            **(metadata or {}),
            ID_COLUMN_KEY: id_column,
            SOURCE_KEY: source_key.to_user_string(),
            RETRY_FAILED_KEY: retry_failed,
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
            table = _to_polars(source)
            store = io_manager.store()
            settings = _settings(base, config, table, store, min_flush_seconds)
            job = {
                "format": JOB_FORMAT,
                "asset": context.asset_key.to_user_string(),
                "code_version": code_version,
                "id_column": settings.id_column,
                "input_columns": list(settings.input_columns),
            }
            imported = None  # read once for every shard of a ranged run
            if config.global_resume and config.resume:
                imported = _global_rows(io_manager, store, context.asset_key, job)
            shards = _Shards(table, settings.id_column)
            frames: list[pl.DataFrame] = []
            stats: list[RunStats] = []
            too_many: list[TooManyFailuresError] = []
            for key in keys:
                try:
                    frame, one = _run_partition(
                        context,
                        config,
                        fn,
                        settings,
                        io_manager.checkpoint(context.asset_key, config.checkpoint_tag, key, store),
                        shards.rows_of(key),
                        key,
                        job,
                        imported,
                    )
                except TooManyFailuresError as e:
                    # A ranged run still finishes its other shards, so their retries are free.
                    too_many.append(e)
                    continue
                frames.append(frame)
                stats.append(one)
            if too_many:
                raise TooManyFailuresError(" ".join(str(e) for e in too_many))
            context.add_output_metadata(_metadata(stats, config))
            return frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed")

        body.__doc__ = fn.__doc__
        return dg.asset(
            name=asset_name,
            key_prefix=key_prefix,
            ins={"source": dg.AssetIn(key=source_key)},
            partitions_def=partitions_def,
            group_name=group_name,
            code_version=code_version,
            pool=pool,
            tags=dict(tags) if tags else None,
            description=description or inspect.getdoc(fn),
            metadata=definition_metadata,
            io_manager_key=io_manager_key,
            backfill_policy=backfill_policy,
            kinds={"polars", "parquet"},
        )(body)

    return decorator


def _settings(
    base: Settings,
    config: CheckpointRunConfig,
    source: pl.DataFrame,
    store: Store,
    min_flush_seconds: float | None,
) -> Settings:
    """The engine settings of this run: the decorator's, with the run config applied."""
    if min_flush_seconds is None and isinstance(store, ObjectStore):
        min_flush = DEFAULT_MIN_FLUSH_SECONDS_OBJECT_STORE
    else:
        min_flush = base.min_flush_seconds
    return dataclasses.replace(
        base,
        input_columns=base.input_columns or tuple(c for c in source.columns if c != base.id_column),
        min_flush_seconds=min_flush,
        checkpoint_interval=config.checkpoint_interval or base.checkpoint_interval,
        resume=config.resume,
        checkpointing=config.checkpointing,
        retry_failed=base.retry_failed if config.retry_failed is None else config.retry_failed,
        on_input_change=(
            config.on_input_change.value if config.on_input_change else base.on_input_change
        ),
    )


class _Shards:
    """The input rows of each partition; ids are hashed once for all shards of a run."""

    def __init__(self, source: pl.DataFrame, id_column: str) -> None:
        self.source = source
        self.id_column = id_column
        self._of: tuple[int, np.ndarray] | None = None  # (shard count, shard of each row)

    def rows_of(self, partition: str | None) -> pl.DataFrame:
        shard = parse_shard(partition) if partition else None
        if shard is None or self.id_column not in self.source.columns:
            return self.source  # missing ids fail in prepare(), with a clear error
        if self._of is None or self._of[0] != shard.count:
            ids = self.source.get_column(self.id_column)
            self._of = (shard.count, hashing.shard_of(ids, shard.count))
        return self.source.filter(pl.Series(self._of[1] == shard.index))


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
) -> tuple[pl.DataFrame, RunStats]:
    """Run one partition's checkpoint over its input rows; returns its result and stats."""
    if config.limit is not None:
        source = source.head(config.limit)
    inputs = runner.prepare(source, settings)
    shard = parse_shard(partition) if partition else None
    scheme: dict[str, Any]
    if shard is not None:
        scheme = {"kind": "shard", "index": shard.index, "count": shard.count}
    elif partition is not None:
        scheme = {"kind": "partition", "key": partition}
    else:
        scheme = {"kind": "all"}
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
        scheme=scheme,
        run_id=context.run_id,
        is_run_finished=is_run_finished,
        logger=context.log,  # type: ignore[arg-type]
        label=label,
        imported=imported,
    )


def _global_rows(
    io_manager: CheckpointIOManager, store: Store, asset_key: dg.AssetKey, job: dict[str, Any]
) -> pl.DataFrame:
    """The rows of this job in the asset's global resume table."""
    key = global_resume_key(asset_key)
    path = io_manager.output_path(store, key, None)
    try:
        data = store.get(path)
    except FileNotFoundError:
        raise CheckpointError(
            f"`global_resume: true` needs the table of {key.to_user_string()} at "
            f"{store.display(path)}, which does not exist. Add global_resume_asset("
            f"{asset_key.path[-1]}) to your Definitions and materialize it first."
        ) from None
    table = pl.read_parquet(io.BytesIO(data))
    if table.height == 0:
        return table
    return table.filter(pl.col(JOB) == hashing.job_fingerprint(job)).drop(JOB)


def _metadata(runs: Sequence[RunStats], config: CheckpointRunConfig) -> dict[str, Any]:
    """Materialization metadata; a ranged run of several shards reports their sums."""
    counts = (
        "rows_total",
        "rows_computed",
        "rows_resumed",
        "rows_failed",
        "rows_reused",
        "rows_dropped",
    )
    out: dict[str, Any] = {k: sum(getattr(r, k) for r in runs) for k in counts}
    seconds = sum(r.seconds for r in runs)
    out["rows_per_second"] = round(out["rows_computed"] / seconds, 2) if seconds else 0.0
    out["input_fingerprint"] = ",".join(r.input_fingerprint for r in runs)
    out["checkpoint_tag"] = config.checkpoint_tag or DEFAULT_TAG
    out["checkpointing"] = config.checkpointing
    paths = [r.checkpoint_path for r in runs if r.checkpoint_path]
    if paths:
        out["checkpoint_path"] = dg.MetadataValue.path(
            paths[0] if len(paths) == 1 else ", ".join(paths)
        )
    requests: dict[str, int] = {}
    for r in runs:
        for k, v in r.requests.items():
            requests[k] = requests.get(k, 0) + v
    out["storage_requests"] = requests
    out["storage_wait_seconds"] = round(sum(r.storage_wait_seconds for r in runs), 3)
    out["calls"] = sum(r.calls for r in runs)
    out["rows_imported"] = sum(r.rows_imported for r in runs)
    return out


def _source_key(source: SourceSpec) -> dg.AssetKey:
    if isinstance(source, dg.AssetsDefinition):
        return source.key
    if isinstance(source, dg.AssetKey):
        return source
    if isinstance(source, str):
        return dg.AssetKey.from_user_string(source)
    return dg.AssetKey(list(source))


def _to_polars(value: Any) -> pl.DataFrame:
    if isinstance(value, pl.DataFrame):
        return value
    if isinstance(value, pl.LazyFrame):
        return value.collect()
    if isinstance(value, pa.Table):
        frame = pl.from_arrow(value)
        assert isinstance(frame, pl.DataFrame)
        return frame
    if type(value).__module__.startswith("pandas"):
        return pl.from_pandas(value)
    raise CheckpointError(
        f"The source of a checkpointed asset must be a polars, pyarrow or pandas table; got "
        f"{type(value).__name__}."
    )
