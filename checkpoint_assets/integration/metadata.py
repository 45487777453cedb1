"""Metadata keys: what a checkpointed asset's definition declares and each materialization
records, named once here and read by the sensor, the checks and the IO manager.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import dagster as dg
import polars as pl

from checkpoint_assets.engine.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import (
    BudgetExceededError,
    CheckpointError,
    FunctionError,
    OutageError,
    QuotaExhaustedError,
    TooManyFailuresError,
)
from checkpoint_assets.engine.rows import CURRENT, ERROR
from checkpoint_assets.engine.settings import RunStats
from checkpoint_assets.engine.storage.base import Usage

# Definition metadata, set by the decorators.
ID_COLUMN = "checkpoint_assets/id_column"
SOURCE = "checkpoint_assets/source"
RETRY_FAILED = "checkpoint_assets/retry_failed"
GLOBAL_RESUME_OF = "checkpoint_assets/global_resume_of"

# Materialization metadata (besides the counts of ``COUNTS``).
ROWS_FAILED = "rows_failed"
CHECKPOINT_TAG = "checkpoint_tag"
CHECKPOINTING = "checkpointing"
THROTTLED_CALLS = "throttled_calls"
THROTTLE_EVENTS = "throttle_events"
THROTTLED_SECONDS = "throttled_seconds"
CONCURRENCY_FINAL = "concurrency_final"
REFUSALS_PER_ANSWER = "refusals_per_answer"  # throttled calls per call the endpoint answered
BUDGET_USED = "budget_used"  # the share of the key's stated (or assumed) budget the run drew
BUDGET_WAIT_SECONDS = "budget_wait_seconds"  # time during which requests waited for budget
USAGE = "usage/"  # + a usage column: its sum over the rows this run computed
USAGE_TOTAL = "usage_total/"  # + a usage column: its sum over every stored row
COST_USD = "cost_usd"  # what this run's calls on the shard cost (a budget's prices)
COST_BY_MODEL = "cost_by_model"  # the same, by model
COST_SHARD_TOTAL_USD = "cost_shard_total_usd"  # what the shard cost over every run
COST_ASSET_TOTAL_USD = "cost_asset_total_usd"  # what the asset cost over every shard and run
ROWS_PER_SECOND = "rows_per_second"
CHECKPOINT_PATH = "checkpoint_path"
STORAGE_REQUESTS = "storage_requests/"  # + put, get, list, delete, head: requests the run made
REQUEST_KINDS = ("PUT", "GET", "LIST", "DELETE", "HEAD")
STORAGE_BYTES_READ = "storage_bytes_read"  # what the run's GETs fetched (its source's ranges too)
TOP_ERRORS = "top_errors"
ROWS_CHECKPOINTED = "rows_checkpointed"
FUNCTION_CHANGED = "function_changed"  # the function changed, its code version did not
FUNCTION_CHANGES = "function_changes"  # what changed, in words (only when it did)
# An observation of a partition whose rows wait in provider batches (submit-and-end), which
# ``provider_batches_sensor`` follows: the batch ids (JSON list) and the rows.
BATCHES_PENDING = "batches_pending"
ROWS_PENDING = "rows_pending"
# Dagster's standard keys (shown in the UI's asset overview and columns tab).
ROW_COUNT = "dagster/row_count"
COLUMN_SCHEMA = "dagster/column_schema"
TOP_ERRORS_SHOWN = 10
SAMPLE_IDS = 5
COUNTS = (
    "rows_total",
    "rows_computed",
    "rows_resumed",
    ROWS_FAILED,
    "rows_reused",
    "rows_dropped",
    "rows_changed",
    "rows_imported",
    "calls",
)


def materialization(
    runs: Sequence[RunStats],
    tag: str,
    checkpointing: bool,
    storage: Usage,
    result: pl.DataFrame | None = None,
    id_column: str | None = None,
) -> dict[str, Any]:
    """The metadata of one materialization; a ranged run of several shards reports their sums.

    ``storage``: what the step asked of storage (reading its source's row groups, its
    checkpoints), counted by the store.

    ``result``: what the asset returns (id, outputs, ``_error``), for Dagster's standard
    ``dagster/row_count`` and ``dagster/column_schema`` and the table of the most common errors.
    """
    out: dict[str, Any] = {k: sum(getattr(r, k) for r in runs) for k in COUNTS}
    seconds = sum(r.seconds for r in runs)
    if out["rows_computed"] and seconds > 0:  # absent on a run that computed nothing
        out[ROWS_PER_SECOND] = round(out["rows_computed"] / seconds, 2)
    out["input_fingerprint"] = ",".join(r.input_fingerprint for r in runs)
    out[CHECKPOINT_TAG] = tag
    out[CHECKPOINTING] = checkpointing
    paths = [r.checkpoint_path for r in runs if r.checkpoint_path]
    if paths:
        out[CHECKPOINT_PATH] = dg.MetadataValue.path(
            paths[0] if len(paths) == 1 else ", ".join(paths)
        )
    requests = {**dict.fromkeys(REQUEST_KINDS, 0), **storage.requests}
    for kind, n in requests.items():  # one number per kind, which the UI plots over time
        out[STORAGE_REQUESTS + kind.lower()] = n
    out[STORAGE_BYTES_READ] = storage.bytes_read
    out["storage_wait_seconds"] = round(sum(r.storage_wait_seconds for r in runs), 3)
    if result is not None:
        out[ROW_COUNT] = result.height
        out[COLUMN_SCHEMA] = column_schema(result, id_column)
        if (
            id_column
            and ERROR in result.columns
            and result.get_column(ERROR).null_count() < (result.height)
        ):
            out[TOP_ERRORS] = top_errors(result, id_column)
    out.update(_throttling(runs))
    out.update(_usage(runs))
    if checkpointing:  # without a checkpoint there is no earlier function to compare with
        out.update(_function(runs))
    return out


def _function(runs: Sequence[RunStats]) -> dict[str, Any]:
    changed = list(dict.fromkeys(c for r in runs for c in r.function_changed))
    if not changed:
        return {FUNCTION_CHANGED: False}
    return {FUNCTION_CHANGED: True, FUNCTION_CHANGES: ", ".join(changed)}


def _throttling(runs: Sequence[RunStats]) -> dict[str, Any]:
    throttled, answered = sum(r.throttled_calls for r in runs), sum(r.calls for r in runs)
    out: dict[str, Any] = {
        THROTTLED_CALLS: throttled,
        THROTTLE_EVENTS: sum(r.throttle_events for r in runs),
        THROTTLED_SECONDS: round(sum(r.throttled_seconds for r in runs), 3),
        CONCURRENCY_FINAL: min((r.concurrency_final for r in runs), default=0),
        BUDGET_WAIT_SECONDS: round(sum(r.budget_wait_seconds for r in runs), 3),
    }
    if answered:
        out[REFUSALS_PER_ANSWER] = round(throttled / answered, 4)
    paced = [r for r in runs if r.budget_used is not None]
    if paced:  # a ranged run's shards one after the other: weighted by their time
        seconds = sum(r.seconds for r in paced)
        used = [(r.budget_used or 0.0) * (r.seconds if seconds else 1) for r in paced]
        out[BUDGET_USED] = round(sum(used) / (seconds or len(paced)), 4)
    return out


def _usage(runs: Sequence[RunStats]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in runs:
        for prefix, sums in ((USAGE, r.usage), (USAGE_TOTAL, r.usage_total)):
            for column, value in sums.items():
                out[prefix + column] = out.get(prefix + column, 0.0) + value
    return out


def column_schema(result: pl.DataFrame, id_column: str | None) -> dg.TableSchema:
    """The result's columns with their polars types: the id, the outputs and ``_error``."""

    def role(name: str) -> str:
        if name == id_column:
            return "row id"
        if name == ERROR:
            return "error of a failed row (null on success)"
        return "output"

    return dg.TableSchema(
        columns=[
            dg.TableColumn(name, str(dtype), description=role(name))
            for name, dtype in result.schema.items()
        ]
    )


def top_errors(result: pl.DataFrame, id_column: str) -> dg.TableMetadataValue:
    """The most common errors of the failed rows: message, rows, sample ids."""
    top = (
        result.filter(pl.col(ERROR).is_not_null())
        .group_by(ERROR)
        .agg(pl.len().alias("rows"), pl.col(id_column).sort().head(SAMPLE_IDS).alias("ids"))
        .sort(["rows", ERROR], descending=[True, False])
        .head(TOP_ERRORS_SHOWN)
    )
    records = [
        dg.TableRecord(
            {"error": error[:500], "rows": rows, "sample_ids": ", ".join(str(i) for i in ids)}
        )
        for error, rows, ids in top.iter_rows()
    ]
    schema = dg.TableSchema(
        columns=[
            dg.TableColumn("error", "string"),
            dg.TableColumn("rows", "int"),
            dg.TableColumn("sample_ids", "string"),
        ]
    )
    return dg.MetadataValue.table(records, schema=schema)


# Failures after which the checkpoint holds this run's work: say what it saved. Errors raised
# before the run starts writing (ids, columns, another job's checkpoint, a held lock) are not
# among them: rerunning alone does not resume past those.
_STOPPED = (
    TooManyFailuresError,
    OutageError,
    QuotaExhaustedError,
    FunctionError,
    BudgetExceededError,
)


@contextmanager
def saved_on_failure(
    context: dg.AssetExecutionContext,
    checkpoint: Checkpoint,
    partition: str | None,
    id_column: str,
    checkpointing: bool,
) -> Iterator[None]:
    """On a failure or interrupt inside, log what the partition's checkpoint holds and record it
    as an ``AssetObservation`` (a failed step cannot carry materialization metadata)."""
    try:
        yield
    except BaseException as error:
        stopped = isinstance(error, _STOPPED) or not isinstance(error, CheckpointError)
        if checkpointing and stopped:
            report_saved(context, checkpoint, partition, id_column, error)
        raise


def report_saved(
    context: dg.AssetExecutionContext,
    checkpoint: Checkpoint,
    partition: str | None,
    id_column: str,
    error: BaseException,
) -> None:
    """Log how many rows ``checkpoint`` holds and that rerunning resumes; record the counts as an
    ``AssetObservation`` of the partition. Never raises: the run's own error matters more."""
    label = context.asset_key.to_user_string() + (f" {partition}" if partition else "")
    why = type(error).__name__
    try:
        meta = checkpoint.meta_file.read()
        stored = checkpoint.load(id_column, meta.base_seq if meta else 0).rows
        if CURRENT in stored.columns:
            stored = stored.filter(pl.col(CURRENT).fill_null(True))
        errors = stored.get_column(ERROR) if ERROR in stored.columns else None
        failed = 0 if errors is None else stored.height - errors.null_count()
        ok = stored.height - failed
    except Exception as e:
        context.log.warning(
            f"{label} stopped ({why}); what its checkpoint {checkpoint.url} holds could not be "
            f"read: {e}"
        )
        return
    context.log.warning(
        f"{label} stopped ({why}): {ok:,} rows are checkpointed at {checkpoint.url}"
        f"{f' and {failed:,} stored as failed' if failed else ''}, counting this run's and "
        "earlier runs'. Materializing the partition again resumes from them; only the rest is "
        "computed."
    )
    context.log_event(
        dg.AssetObservation(
            asset_key=context.asset_key,
            partition=partition,
            metadata={
                ROWS_CHECKPOINTED: ok,
                ROWS_FAILED: failed,
                CHECKPOINT_PATH: dg.MetadataValue.path(checkpoint.url),
                "stopped_by": why,
            },
        )
    )


def plain(value: Any) -> Any:
    """A metadata entry's plain value (``MetadataValue`` or already plain)."""
    return value.value if isinstance(value, dg.MetadataValue) else value
