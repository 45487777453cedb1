"""Errors raised by the checkpoint engine.

Every message says what happened and what to do; stored work is never touched by the failing
operation.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by checkpoint-assets."""


class InvalidIdsError(CheckpointError):
    """The id column is missing, has nulls, has duplicates or has an unsupported type."""


class InputChangedError(CheckpointError):
    """Finished rows whose input columns changed since their result was stored."""


class JobMismatchError(CheckpointError):
    """The checkpoint was written by a different job (code version, columns or output schema)."""


class CorruptCheckpointError(CheckpointError):
    """A stored file is unreadable or violates the checkpoint's invariants."""


class LockHeldError(CheckpointError):
    """Another live writer holds the checkpoint's lock."""


class StorageError(CheckpointError):
    """The storage backend cannot be reached or used (missing package, bucket, permission)."""


class TooManyFailuresError(CheckpointError):
    """More rows failed than the asset tolerates; everything else is checkpointed."""


class OutageError(CheckpointError):
    """Every row of several consecutive batches failed: the endpoint looks down."""
