"""What a stopped run's checkpoint holds, said when its step fails: logged, and recorded as an
``AssetObservation`` of the partition (a failed step carries no materialization metadata)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg
import polars as pl

from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import (
    BudgetExceededError,
    CheckpointError,
    FunctionError,
    OutageError,
    QuotaExhaustedError,
    TooManyFailuresError,
)
from checkpoint_assets.engine.rows import CURRENT, ERROR
from checkpoint_assets.integration.metadata import (
    CHECKPOINT_PATH,
    OBSERVATION,
    ROWS_CHECKPOINTED,
    ROWS_FAILED,
    STOPPED_BY,
    declared,
)

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
            metadata=declared(
                {
                    ROWS_CHECKPOINTED: ok,
                    ROWS_FAILED: failed,
                    CHECKPOINT_PATH: dg.MetadataValue.path(checkpoint.url),
                    STOPPED_BY: why,
                },
                OBSERVATION,
            ),
        )
    )
