"""What to do about an engine error, in Dagster's terms: run config keys, ``code_version``, the
sensor. The engine's errors carry the facts and a remedy in its own terms; this replaces it."""

from __future__ import annotations

from checkpoint_assets.engine.errors import (
    SHARED_CHECKPOINT,
    BudgetExceededError,
    CheckpointError,
    CorruptCheckpointError,
    FunctionError,
    InputChangedError,
    JobChangedError,
    JobMismatchError,
    MissingColumnsError,
    OutageError,
    QuotaExhaustedError,
    TooManyFailuresError,
)

_RERUN = "Materialize the partition again, or let failed_partitions_sensor retry it: it resumes."


def advise(error: CheckpointError) -> CheckpointError:
    """``error`` with its remedy worded for a Dagster user (returned for ``raise advise(e)``)."""
    if isinstance(error, InputChangedError):
        error.advise(
            "Run with `on_input_change: recompute` in run config to recompute just the changed "
            "rows, `resume: false` to recompute everything, or set a new `checkpoint_tag`."
        )
    elif isinstance(error, JobChangedError):
        error.advise(
            "To start the new job here, materialize once with `resume: false` in run config: it "
            "replaces the stored results, and later runs resume the new ones. To keep both, set "
            "a new `checkpoint_tag` in run config. To resume the stored results, set "
            f"{_restore(error)}."
        )
    elif isinstance(error, JobMismatchError) and error.remedy == JobMismatchError.REMEDY:
        error.advise(
            "For a new job, change the asset's `code_version` or set a new `checkpoint_tag` in "
            "run config; to replace the stored results, run with `resume: false`."
        )
    elif isinstance(error, CorruptCheckpointError) and error.remedy == SHARED_CHECKPOINT:
        error.advise(
            "Two different jobs probably share this checkpoint: give each its own "
            "`checkpoint_tag` in run config, or start over with `resume: false`."
        )
    elif isinstance(error, MissingColumnsError):
        error.advise(
            "Set the checkpointed asset's `input_columns=` to columns of its source asset, or "
            "add the missing columns to the source."
        )
    elif isinstance(error, TooManyFailuresError) and error.missing_results:
        error.advise(
            "Make the function return one row per input id (with the asset's `id_column`), or "
            "raise for the rows it cannot do: they are stored as failed and retried. Then "
            "materialize the partition again: only the failed rows are computed."
        )
    elif isinstance(error, TooManyFailuresError):
        error.advise(
            "The failed rows are retried on the next run while `retry_failed` is on (materialize "
            "the partition again, or let failed_partitions_sensor do it); raise "
            "`max_failed_fraction` to tolerate them."
        )
    elif isinstance(error, OutageError):
        error.advise(f"When the endpoint is back: {_RERUN}")
    elif isinstance(error, QuotaExhaustedError):
        error.advise(
            "Check the endpoint's quota or plan, or raise the asset's `max_throttle_seconds`; "
            f"then {_RERUN[0].lower()}{_RERUN[1:]}"
        )
    elif isinstance(error, BudgetExceededError):
        error.advise(
            f"To go on, raise the limit for a run in run config, `budget: {{{error.limit_name}: "
            "<USD>}` (or in the asset's `budget=`), and materialize the partition again: it "
            "resumes where this stopped. failed_partitions_sensor does not retry it."
        )
    elif isinstance(error, FunctionError):
        error.advise(f"Fix the function, then: {_RERUN}")
    return error


def _restore(error: JobChangedError) -> str:
    """The settings that resume the stored results, as the user writes them."""
    return " and ".join(
        f"the asset's `{k}` back to {old!r}" if k in _ARGUMENTS else f"`{k}` back to {old!r}"
        for k, (old, _) in error.changed.items()
    )


# Job settings that are arguments of `checkpointed_asset`.
_ARGUMENTS = ("code_version", "id_column", "input_columns")
