"""Rebuild a damaged checkpoint from what is readable, keeping every damaged file aside.

``repair`` takes the checkpoint's lock. A checkpoint a live run holds is refused, with its holder
named; a dead holder's lock is taken over. Then it:

1. deletes temporary files of killed local writes older than ``STALE_TEMPORARY_SECONDS``;
2. with a readable meta file, moves aside (to ``<name>.parquet.quarantine/``) every file that
   ``verify`` would flag. Those are the merged file and unmerged parts that are unreadable or
   break the checkpoint's invariants: no id column, duplicate ids, missing output columns, ids of
   another type. When the merged file is moved aside, parts it had already merged but that are
   still stored are used again. Then it merges what is left into a new merged file, as
   ``compact`` does, and records the new counts in the meta file. Rows lost with a damaged file
   are simply not stored: the next run computes them again. So are the rows of flushes that no
   part holds while later ones do. Such parts were deleted outside this package. The gap is
   confirmed by listing again, in case the listing lags. Those flushes are named, and the new
   merged file covers them;
3. with a meta file that is unreadable, or missing while data files remain, cannot rebuild the
   meta file. Nothing else records the job that wrote the rows (code version, settings), and
   rows of an unknown job are never resumed. It says so and moves the meta file and every data
   file aside. The next run starts the checkpoint again; the rows stay readable in quarantine.

Nothing is ever deleted but temporary files and parts whose rows are in the new merged file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.gaps import describe_flushes
from checkpoint_assets.engine.checkpoints.meta import Meta
from checkpoint_assets.engine.errors import CorruptCheckpointError
from checkpoint_assets.engine.loop.lock import Lease
from checkpoint_assets.engine.rows import CURRENT, ERROR
from checkpoint_assets.engine.upkeep.verify import file_problem


@dataclass(frozen=True)
class Moved:
    """A damaged file moved aside: from where, to where, and why."""

    path: str
    to: str
    problem: str


@dataclass
class Repaired:
    """What ``repair`` did to one checkpoint (paths as a user can paste them)."""

    name: str
    moved: list[Moved] = field(default_factory=list)
    removed_temporary: list[str] = field(default_factory=list)
    parts_merged: int = 0  # parts merged into the rebuilt merged file
    rows_ok: int = 0  # rows of the result afterwards
    rows_failed: int = 0
    meta_lost: str | None = None  # why the meta file could not be used, when it could not
    missing: list[tuple[int, int]] = field(default_factory=list)  # flushes no file held

    def summary(self) -> str:
        """One sentence for people."""
        if self.meta_lost is not None:
            return (
                f"could not rebuild the meta file ({self.meta_lost}); moved {len(self.moved)} "
                "file(s) aside: the next run starts the checkpoint again"
            )
        did = [f"moved {len(self.moved)} damaged file(s) aside"] if self.moved else []
        if self.missing:
            gaps = describe_flushes(self.missing)
            did.append(f"no part held {gaps}: their rows are computed again")
        if self.parts_merged:
            did.append(f"merged {self.parts_merged} part(s)")
        if self.removed_temporary:
            did.append(f"removed {len(self.removed_temporary)} stale temporary file(s)")
        kept = f"{self.rows_ok:,} rows ok, {self.rows_failed:,} failed"
        return f"{'; '.join(did) or 'nothing to repair'}: {kept}"


def repair(checkpoint: Checkpoint) -> Repaired:
    """Repair ``checkpoint`` under its lock (see the module docstring).

    Raises ``LockHeldError`` when a live run holds it, and ``CheckpointError`` when there is no
    such checkpoint. Example::

        done = repair(Checkpoint(open_store("s3://bucket/checkpoints"), "a/default/all"))
        print(done.summary())
    """
    lease = Lease(checkpoint.store, checkpoint.files.lock)
    lease.acquire()
    try:
        done = Repaired(checkpoint.name)
        try:  # first: a meta of a newer format stops repair before any file is touched
            meta = checkpoint.meta_file.read()
            lost = None if meta is not None else "it is missing"
        except CorruptCheckpointError as e:
            meta, lost = None, f"it {e.problem}"
        removed = checkpoint.remove_stale_temporary()
        done.removed_temporary = [checkpoint.store.display(p) for p in removed]
        if meta is None:
            _set_all_aside(checkpoint, done, lost or "")
        else:
            _rebuild(checkpoint, meta, done)
        return done
    finally:
        lease.release()


def _move(checkpoint: Checkpoint, done: Repaired, path: str, problem: str) -> None:
    to = checkpoint.set_aside(path)
    display = checkpoint.store.display
    done.moved.append(Moved(display(path), display(to), problem))


def _set_all_aside(checkpoint: Checkpoint, done: Repaired, lost: str) -> None:
    data = checkpoint.data_files()
    if not data and lost == "it is missing":
        raise checkpoint.damage.no_checkpoint()
    done.meta_lost = (
        f"{lost}, and it is the only record of the job that wrote the rows, which are never "
        "resumed for an unknown job"
    )
    if lost != "it is missing":
        _move(checkpoint, done, checkpoint.files.meta, f"is unreadable: {lost}")
    for path in data:
        _move(checkpoint, done, path, "its job is unknown without a meta file")


def _rebuild(checkpoint: Checkpoint, meta: Meta, done: Repaired) -> None:
    watermark = merged_to = 0
    try:
        merged, watermark = checkpoint.read_merged()
        merged_to = watermark
        problem = (
            None
            if merged is None
            else file_problem(checkpoint, meta, checkpoint.files.merged, merged)
        )
    except CorruptCheckpointError as e:
        problem = e.problem
    if problem is not None:
        _move(checkpoint, done, checkpoint.files.merged, problem)
        watermark = 0  # the parts it had merged are the only copy of their rows now
    live, redundant = checkpoint.list_parts()
    for part in [*live, *redundant]:
        if part.last <= watermark:
            continue  # in the merged file already: finalize deletes it
        try:
            problem = file_problem(checkpoint, meta, part.path, checkpoint.read_file(part.path))
        except CorruptCheckpointError as e:
            problem = e.problem
        if problem is not None:
            _move(checkpoint, done, part.path, problem)
    outputs = list(meta.output_schema or {})
    stored = checkpoint.load(meta.id_column, meta.base_seq, outputs, accept_gaps=True)
    # Flushes in the merged file moved aside are no news: it is named above.
    done.missing = [(max(a, merged_to + 1), b) for a, b in stored.gaps if b > merged_to]
    # New flushes must stay in the current generation even when its merged file was moved aside.
    stored.next_seq = max(stored.next_seq, meta.base_seq + 1)
    done.parts_merged = len(stored.parts)
    rows = checkpoint.finalize(meta.id_column, None, meta.base_seq, known=stored)
    current = rows.filter(pl.col(CURRENT)) if CURRENT in rows.columns else rows
    failed = int(current.get_column(ERROR).is_not_null().sum()) if ERROR in current.columns else 0
    done.rows_ok, done.rows_failed = current.height - failed, failed
    if done.moved and meta.rows:
        meta.rows = {**meta.rows, "ok": done.rows_ok, "failed": done.rows_failed}
        checkpoint.meta_file.write(meta)
