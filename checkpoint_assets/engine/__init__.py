"""The checkpoint engine: storage, fingerprints, resume, locking, compaction. No Dagster here."""

from checkpoint_assets.engine.checkpoint import Checkpoint, Meta
from checkpoint_assets.engine.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InputChangedError,
    InvalidIdsError,
    JobMismatchError,
    LockHeldError,
    OutageError,
    StorageError,
    TooManyFailuresError,
)
from checkpoint_assets.engine.runner import RunStats, Settings, prepare, run
from checkpoint_assets.engine.storage import Store, open_store

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CorruptCheckpointError",
    "InputChangedError",
    "InvalidIdsError",
    "JobMismatchError",
    "LockHeldError",
    "Meta",
    "OutageError",
    "RunStats",
    "Settings",
    "StorageError",
    "Store",
    "TooManyFailuresError",
    "open_store",
    "prepare",
    "run",
]
