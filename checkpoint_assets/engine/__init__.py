"""The checkpoint engine: storage, fingerprints, resume, locking, compaction. No Dagster here.

Its rooms, top to bottom (a room imports only those below it; ARCHITECTURE.md says more):

- ``providers/``: rows sent through a provider's batch API; ``upkeep/``: verify and repair;
- ``loop/``: one run of one shard, its lock, its work loop and its flushes;
- ``plan/``: what is stored, what is reused and what is left to do;
- ``settings.py``: run settings and their defaults;
- ``calls/``: calls to the user's function, their rate limits and their cost;
  ``checkpoints/``: one checkpoint's files;
- ``sharding/``: hashes, shards and the keyed layout;
- ``storage/``: the five operations on any fsspec filesystem, one file per backend;
- ``rows.py``: the columns every stored row carries; ``fields.py``: a declared field's default
  and meaning;
- ``errors/``: what can go wrong.
"""

from checkpoint_assets.engine.calls.batches import PerRow
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.meta import Meta
from checkpoint_assets.engine.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InputChangedError,
    InvalidIdsError,
    JobMismatchError,
    LockHeldError,
    MissingColumnsError,
    OutageError,
    StorageError,
    TooManyFailuresError,
)
from checkpoint_assets.engine.loop.runner import RunContext, prepare, run
from checkpoint_assets.engine.settings import OnInputChange, RunStats, Settings
from checkpoint_assets.engine.sharding.scheme import Scheme, Shard
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
    "MissingColumnsError",
    "OnInputChange",
    "OutageError",
    "PerRow",
    "RunContext",
    "RunStats",
    "Scheme",
    "Settings",
    "Shard",
    "StorageError",
    "Store",
    "TooManyFailuresError",
    "open_store",
    "prepare",
    "run",
]
