"""The checkpoint engine: storage, fingerprints, resume, locking, compaction. No Dagster here.

Where each part lives (ARCHITECTURE.md says more):

- ``storage/``: the five operations on any fsspec filesystem, one file per backend;
- ``layout.py``: every file name under a checkpoint root; ``scheme.py``: shards and partitions;
- ``rows.py``, ``parquet.py``, ``meta.py``: what is stored; ``checkpoint.py`` and
  ``compaction.py``: one checkpoint's files, read, merged and compacted; ``damage.py``: its
  damaged files; ``gaps.py``: its parts, listed when listings lag; ``lock.py``: its writer;
- ``opening.py`` (job check, load, plan; ``resume.py``), ``calls.py`` (the user's function),
  ``batches.py`` (what a call takes and returns), ``workers.py`` (threads or tasks),
  ``sink.py`` (flushes), ``runner.py`` (the loop), ``shard_run.py`` (what loops share): one run;
- ``submissions.py`` (a provider's batch API), ``submission_records.py`` (what was submitted),
  ``provider_batches.py`` (a run through it);
- ``global_resume.py``: finished rows across every checkpoint of an asset;
- ``function_fingerprint.py``: what counts as a change of the user's function;
- ``settings.py``: run settings and their defaults; ``errors.py``: what can go wrong.
"""

from checkpoint_assets.engine.batches import PerRow
from checkpoint_assets.engine.checkpoint import Checkpoint
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
from checkpoint_assets.engine.meta import Meta
from checkpoint_assets.engine.runner import RunContext, prepare, run
from checkpoint_assets.engine.scheme import Scheme, Shard
from checkpoint_assets.engine.settings import OnInputChange, RunStats, Settings
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
