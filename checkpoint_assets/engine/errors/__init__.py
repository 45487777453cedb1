"""Errors raised by the checkpoint engine.

Each error carries the facts of what happened (ids, paths, fingerprints) as attributes, and a
``remedy``: what to do. Each class words its own remedy twice. ``engine_remedy`` is in the
engine's terms (settings, the CLI). ``dagster_remedy`` is in Dagster's (run config keys,
``code_version``, the sensor); the Dagster layer asks for it with
:meth:`CheckpointError.in_dagster_terms`. A remedy given where the error is raised (``advise``)
says more than the class's, so it is kept in both. The message a user reads is always ``what
happened`` followed by ``what to do``. The failing operation never touches stored work.

The files: ``base.py`` (``CheckpointError``), ``checkpoint.py`` (a checkpoint's input, job,
files, lock and storage), ``stops.py`` (what stops a run early). Import the errors from here.
"""

from checkpoint_assets.engine.errors.base import CheckpointError
from checkpoint_assets.engine.errors.checkpoint import (
    CorruptCheckpointError,
    InputChangedError,
    InvalidIdsError,
    JobChangedError,
    JobMismatchError,
    LockHeldError,
    MissingColumnsError,
    NewerFormatError,
    RunStoppedError,
    StorageError,
)
from checkpoint_assets.engine.errors.stops import (
    BatchesPendingError,
    BudgetExceededError,
    FunctionError,
    OutageError,
    QuotaExhaustedError,
    TooManyFailuresError,
)

__all__ = [
    "BatchesPendingError",
    "BudgetExceededError",
    "CheckpointError",
    "CorruptCheckpointError",
    "FunctionError",
    "InputChangedError",
    "InvalidIdsError",
    "JobChangedError",
    "JobMismatchError",
    "LockHeldError",
    "MissingColumnsError",
    "NewerFormatError",
    "OutageError",
    "QuotaExhaustedError",
    "RunStoppedError",
    "StorageError",
    "TooManyFailuresError",
]
