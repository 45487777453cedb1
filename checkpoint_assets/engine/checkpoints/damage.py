"""Damaged files of one checkpoint: what is said about them, and the quarantine they go to.

Nothing unreadable is ever taken as done, and nothing damaged is ever deleted:

- An unmerged part that is not Parquet (truncated, garbage). The lock holder that loads it (a
  run, ``checkpoint-assets repair``) moves it aside to ``<name>.parquet.quarantine/``
  (``layout.py``). It says so in a warning naming both places, and reads on without it. The
  part's rows are not stored, so the run computes them again. "Moving" is a copy, then a delete
  (one PUT and one DELETE on object stores). A crash between the two leaves the file in both
  places, and the next run moves it again. A reader without the lock (``status``, a downstream
  load) never moves anything. It raises ``CorruptCheckpointError`` saying what the next run or
  ``repair`` will do.
- An unreadable merged file stops any run with ``CorruptCheckpointError``: its rows may exist
  nowhere else. The remedy names ``checkpoint-assets verify`` and ``checkpoint-assets repair``,
  which rebuilds the checkpoint from what is readable (``repair.py``).
- A meta file that is not valid meta (garbage JSON), or missing while other files of the
  checkpoint remain: the run stops with ``CorruptCheckpointError``. The meta file is the only
  record of the job that wrote the rows (code version, settings). Rows of an unknown job are
  never resumed. ``repair`` cannot rebuild the meta file, so it moves the meta and the data files
  aside, their rows kept there. The next run starts the checkpoint again. Restoring a copy of
  the meta file is the other way out.
- Parts and files that already are below the merged file's watermark are not read: they are
  deleted by the next finalize whatever they hold.
- A temporary file left by a killed local write (``<file>.tmp-<hex>``, see ``storage/local.py``)
  is never read or counted as a part. Object stores have none. Finalize (and so ``compact``) and
  ``repair`` delete those older than ``STALE_TEMPORARY_SECONDS``, which no write takes.

A part missing from the listing (a gap in the flush numbers) is ``gaps.py``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import polars as pl

from checkpoint_assets.engine import rows
from checkpoint_assets.engine.checkpoints.layout import Files
from checkpoint_assets.engine.errors import CheckpointError, CorruptCheckpointError
from checkpoint_assets.engine.rows import ERROR
from checkpoint_assets.engine.storage import FileInfo, Store
from checkpoint_assets.engine.storage.local import is_temporary

Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]

# No write of one file takes this long: a temporary file this old is a killed writer's.
STALE_TEMPORARY_SECONDS = 15 * 60


class Damage:
    """What is said and done about the damaged (or missing) files of the checkpoint ``name``."""

    def __init__(self, store: Store, name: str, files: Files) -> None:
        self.store = store
        self.name = name
        self.files = files

    def command(self, verb: str) -> str:
        """The command line of ``checkpoint-assets VERB`` for this checkpoint, to paste."""
        return f"`checkpoint-assets {verb} {self.store.url} {self.name}`"

    # -- what to do ----------------------------------------------------------------------
    def remedy_without_meta(self) -> str:
        return (
            "Restore the meta file if you have a copy. Otherwise run "
            f"{self.command('repair')}. The meta file is the only record of the job that wrote "
            "the rows, so it cannot be rebuilt. Repair moves the checkpoint's files aside to "
            f"{self.store.display(self.files.quarantine)}/, keeping their rows there. The next "
            "run computes every row again."
        )

    def remedy_merged(self) -> str:
        return (
            f"Run {self.command('verify')} to see every problem, then {self.command('repair')}"
            ". Repair rebuilds the checkpoint from what is readable and keeps the damaged file in "
            f"{self.store.display(self.files.quarantine)}/. The rows lost with it are computed "
            "again on the next run."
        )

    def remedy_part(self) -> str:
        return (
            "The next run of this checkpoint moves it aside to "
            f"{self.store.display(self.files.quarantine)}/ and computes its rows again; "
            f"{self.command('repair')} does that now."
        )

    # -- what is wrong -------------------------------------------------------------------
    def no_checkpoint(self) -> CheckpointError:
        """The error of a command given this checkpoint when none of its files exist."""
        return CheckpointError(
            f"No checkpoint {self.name!r} under {self.store.url}: none of its files exist.",
            f"`checkpoint-assets status {self.store.url}` lists the checkpoints there.",
        )

    def unreadable(self, path: str, error: Exception) -> CorruptCheckpointError:
        """The error of the file at ``path``, which ``error`` kept from being decoded."""
        remedy = self.remedy_merged() if path == self.files.merged else self.remedy_part()
        text = str(error).strip()
        first_line = text.splitlines()[0] if text else type(error).__name__
        return CorruptCheckpointError(
            self.store.display(path), f"is unreadable ({first_line})", remedy
        )

    def check_file(
        self, frame: pl.DataFrame, id_column: str, path: str, outputs: Sequence[str] | None = None
    ) -> None:
        """Raise ``CorruptCheckpointError`` unless the file at ``path`` (holding ``frame``) has
        the id column, unique ids and, where it holds successes, the ``outputs``."""
        where = self.store.display(path)
        missing = [c for c in outputs or () if c not in frame.columns]
        if missing and ERROR in frame.columns and frame.get_column(ERROR).is_null().any():
            problem = f"holds results without the output columns {missing} (it has {frame.columns})"
            raise CorruptCheckpointError(where, problem)
        if id_column not in frame.columns:
            problem = f"has no id column {id_column!r} (it has {frame.columns})"
            raise CorruptCheckpointError(where, problem)
        ids = frame.get_column(id_column)
        if rows.distinct_count(ids) != frame.height:
            dupes = ids.filter(ids.is_duplicated()).unique().head(5).to_list()
            problem = f"holds duplicate ids {dupes}, which this package never writes"
            raise CorruptCheckpointError(where, problem)

    # -- what is done --------------------------------------------------------------------
    def set_aside(self, path: str, log: Logger | None = None) -> str:
        """Move the damaged file ``path`` into the quarantine folder (copy, then delete; never
        lost), saying so on ``log`` when given; returns where it went. Only the lock holder
        calls it."""
        to = self.files.quarantined(path, time.time())
        data = self.store.get_or_none(path)
        if data is not None:
            self.store.put(to, data)
            self.store.delete([path])
        if log is not None:
            log.warning(
                "Checkpoint file %s is unreadable: moved it aside to %s; the rows it held are "
                "computed again.",
                self.store.display(path),
                self.store.display(to),
            )
        return to

    def remove_stale_temporary(self, listed: Iterable[FileInfo]) -> list[str]:
        """Delete the temporary files of killed local writes among ``listed`` (this
        checkpoint's files) older than ``STALE_TEMPORARY_SECONDS``; returns their paths."""
        cutoff = time.time() - STALE_TEMPORARY_SECONDS
        old = [
            f.path
            for f in listed
            if is_temporary(f.path) and f.mtime is not None and f.mtime < cutoff
        ]
        self.store.delete(old)
        return old
