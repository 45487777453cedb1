"""The errors of a checkpoint and what it is given: its input (ids, columns, changed rows), its
job, its files, its lock and its storage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from checkpoint_assets.engine.errors.base import CheckpointError


class InvalidIdsError(CheckpointError):
    """The id column is missing, has nulls, has duplicates or has an unsupported type.

    Only integers (up to 64 bits) and strings are ids. The message names the column and up to
    five offending values. It is raised before any call.
    """

    def __init__(self, column: str, problem: str, sample: Sequence[Any] = ()) -> None:
        self.column = column
        self.problem = problem
        self.sample = list(sample)[:5]
        what = f"The id column {column!r} {problem}"
        if self.sample:
            what += f", e.g. {self.sample}"
        super().__init__(what + ".")

    def engine_remedy(self) -> str:
        return (
            "Every row needs a unique integer or string id: fix the source, or choose another "
            "id column."
        )


class MissingColumnsError(CheckpointError):
    """Input columns the job reads (``input_columns``) are not in the source."""

    def __init__(self, missing: Sequence[str], available: Sequence[str]) -> None:
        self.missing = list(missing)
        self.available = list(available)
        super().__init__(f"The input has no column(s) {self.missing} (it has {self.available}).")

    def engine_remedy(self) -> str:
        return "Set input_columns to columns of the source, or add the missing ones to the source."

    def dagster_remedy(self) -> str:
        return (
            "Set the checkpointed asset's `input_columns=` to columns of its source asset, or "
            "add the missing columns to the source."
        )


class InputChangedError(CheckpointError):
    """Finished rows whose input columns changed since their result was stored.

    The message counts them and gives sample ids. A result is never joined to another input:
    ``on_input_change: recompute`` computes just those rows again.
    """

    def __init__(self, changed: int, total: int, sample_ids: Sequence[Any]) -> None:
        self.changed = changed
        self.total = total
        self.sample_ids = list(sample_ids)[:5]
        super().__init__(
            "Checkpoint input fingerprint does not match current data. "
            f"{changed} of {total} finished rows changed their input columns since their "
            f"results were stored (ids {self.sample_ids}...). Results are never joined "
            "to different inputs."
        )

    def engine_remedy(self) -> str:
        return (
            "Run with on_input_change='recompute' to recompute just the changed rows, "
            "resume=False to recompute everything, or a new checkpoint tag."
        )

    def dagster_remedy(self) -> str:
        return (
            "Run with `on_input_change: recompute` in run config to recompute just the changed "
            "rows, `resume: false` to recompute everything, or set a new `checkpoint_tag`."
        )


class JobMismatchError(CheckpointError):
    """The checkpoint was written by a different job.

    Another ``code_version``, id column or input columns, or an output schema that differs from
    what the function now returns.
    """

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        super().__init__(what)

    def engine_remedy(self) -> str:
        return (
            "Use a new checkpoint tag (or code version) for this job, or run with resume=False "
            "to replace the stored results."
        )

    def dagster_remedy(self) -> str:
        return (
            "For a new job, change the asset's `code_version` or set a new `checkpoint_tag` in "
            "run config; to replace the stored results, run with `resume: false`."
        )


class JobChangedError(JobMismatchError):
    """The checkpoint was written by another job of this asset: ``changed`` maps each setting
    that differs (``code_version``, ``input_columns``...) to its stored and current values.

    A checkpoint holds one job. The remedy names the steps that start the new one here, and the
    value that resumes the stored results."""

    def __init__(self, path: str, changed: dict[str, tuple[Any, Any]]) -> None:
        self.changed = changed
        differs = "; ".join(
            f"{k}: {old!r} stored, {new!r} now" for k, (old, new) in changed.items()
        )
        super().__init__(
            path,
            f"Checkpoint {path} was written by a different job of this asset ({differs}). Results "
            "of one job are never mixed with another's.",
        )

    def engine_remedy(self) -> str:
        return (
            "To start the new job here, run once with resume=False: it replaces the stored "
            "results, and later runs resume the new ones. To keep both, use a new checkpoint "
            f"tag. To resume the stored results, set {self.restore()}."
        )

    def dagster_remedy(self) -> str:
        restore = " and ".join(
            f"the asset's `{k}` back to {old!r}" if k in _ARGUMENTS else f"`{k}` back to {old!r}"
            for k, (old, _) in self.changed.items()
        )
        return (
            "To start the new job here, materialize once with `resume: false` in run config: it "
            "replaces the stored results, and later runs resume the new ones. To keep both, set "
            f"a new `checkpoint_tag` in run config. To resume the stored results, set {restore}."
        )

    def restore(self) -> str:
        """The settings and values that resume the stored results, in words."""
        return " and ".join(f"{k} back to {old!r}" for k, (old, _) in self.changed.items())


# Job settings that are arguments of the decorators (the others are run config keys).
_ARGUMENTS = ("code_version", "id_column", "input_columns")


class CorruptCheckpointError(CheckpointError):
    """A stored file is unreadable or violates the checkpoint's invariants.

    A merged file, part or meta file that cannot be read, a meta file missing beside the other
    files, stored rows without the job's output columns, or a submission record that cannot be
    read. Usually a file was changed or cut short outside the package.
    ``checkpoint-assets verify`` lists every problem.
    """

    def __init__(self, path: str, problem: str, remedy: str | None = None) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"Checkpoint file {path} {problem}.", remedy)

    # Without a remedy of its own: the likely cause is two jobs sharing the checkpoint.
    def engine_remedy(self) -> str:
        return (
            "Two different jobs probably share this checkpoint: give each its own checkpoint "
            "tag, or start over with resume=False."
        )

    def dagster_remedy(self) -> str:
        return (
            "Two different jobs probably share this checkpoint: give each its own "
            "`checkpoint_tag` in run config, or start over with `resume: false`."
        )


class NewerFormatError(CheckpointError):
    """A checkpoint file was written by a newer version of checkpoint-assets, in a format this
    version cannot read: it is left untouched."""

    def __init__(self, path: str, found: int, readable: int) -> None:
        self.path = path
        self.found = found
        self.readable = readable
        super().__init__(
            f"Checkpoint file {path} was written by a newer version of checkpoint-assets (format "
            f"{found}; this version reads up to {readable}). Nothing was read or changed."
        )

    def engine_remedy(self) -> str:
        return (
            "Upgrade checkpoint-assets (pip install -U checkpoint-assets) in every process that "
            "runs, reads or repairs this checkpoint; or give this version a new checkpoint tag."
        )


class LockHeldError(CheckpointError):
    """Another live writer holds the checkpoint's lock.

    The message names its run id, host, pid and since when. It says when the holder's run is
    over while its process still runs: such a step stops by itself within seconds. It is also
    raised when this run lost its lock: its lease ran out while it was paused, or another writer
    took it over. The run then started no more calls and wrote nothing more. It is raised too
    when a file vanished while this run read it: a second writer changed the checkpoint. A dead
    holder's lock (its process gone on its host, or its lease expired) is taken over with a
    warning.
    """

    def __init__(self, what: str, remedy: str | None = None) -> None:
        super().__init__(what, remedy)
        self.holder: str | None = None  # who holds it, when known


class RunStoppedError(CheckpointError):
    """The step stopped by itself while it held the lock.

    It stops when its run is over in the instance: failed, canceled or succeeded. Run monitoring
    marks a run so when its worker died. It also stops when the process that launched it is gone
    (a run worker, or ``dagster asset materialize``). It stored the rows it computed and released
    the lock: a rerun resumes.
    """

    def __init__(self, label: str, reason: str, done: int) -> None:
        self.label = label
        self.reason = reason
        self.done = done
        super().__init__(
            f"{label}: stopped by itself: {reason}. It stored the {done:,} rows it computed "
            "and released the lock."
        )

    def engine_remedy(self) -> str:
        return "Run it again: it resumes."


class StorageError(CheckpointError):
    """The storage cannot be reached or used.

    A missing filesystem package (``s3fs``, ``gcsfs``, ``adlfs``), a missing bucket, denied
    access, an unreachable endpoint, or a ``base_dir`` that is a file or read-only. Also a listing
    of the parts that stays stale: it misses parts the run wrote or saw, or leaves out flushes
    that later parts follow. Nothing is computed, merged or deleted then.
    """
