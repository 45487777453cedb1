"""One checkpoint on storage: its files (see ``layout.py``), read, merged, compacted, finalized.

Sequence numbers order everything. A flush takes the next number after the highest one on storage:
the merged file's watermark or any part's ``<last>``. So the order survives restarts and never
depends on clocks. The merged file records, inside its own Parquet metadata, the highest sequence
it contains (the watermark): parts at or below it are already merged. That makes finalize
crash-safe with a single atomic write. It merges, writes ``<name>.parquet`` (atomic), then deletes
the merged parts. A crash between the two leaves parts that readers skip and the next writer
deletes.

Rows are resolved per id by the rule of ``rows.py``; compaction is described in
``compaction.py``.

Damaged files (what is said about them, the quarantine they go to) are ``damage.py``'s. Parts
missing from a listing that lags behind writes (gaps in the flush numbers) are ``gaps.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import polars as pl

from checkpoint_assets.engine import rows
from checkpoint_assets.engine.checkpoints import parquet
from checkpoint_assets.engine.checkpoints.compaction import (
    COMPACT_FANOUT,
    Part,
    PartCache,
    mergeable_run,
)
from checkpoint_assets.engine.checkpoints.damage import Damage, Logger
from checkpoint_assets.engine.checkpoints.gaps import Flushes, PartListing
from checkpoint_assets.engine.checkpoints.layout import Files
from checkpoint_assets.engine.checkpoints.meta import Meta, MetaFile
from checkpoint_assets.engine.errors import CorruptCheckpointError, LockHeldError
from checkpoint_assets.engine.rows import CURRENT, ERROR, INPUT_HASH, SEQ
from checkpoint_assets.engine.storage import FileInfo, Store


@dataclass
class Stored:
    """Everything a checkpoint holds, resolved to one winning row per id."""

    rows: pl.DataFrame
    watermark: int
    next_seq: int
    parts: list[Part]  # live, unmerged parts
    leftover: list[Part] = field(default_factory=list)  # merged or covered, not yet deleted
    files: int = 0  # data files found (merged file and parts), before any was moved aside
    quarantined: list[str] = field(default_factory=list)  # damaged parts moved aside (to)
    gaps: list[Flushes] = field(default_factory=list)  # flushes no file holds (``accept_gaps``)


class Checkpoint:
    """The files of one checkpoint under a store. Readers need no lock; writers hold one.

    ``fence``: called before every write and delete (the writer's ``Lease.check``), so a writer
    that lost its lock changes nothing more.

    What happens to damaged files is ``self.damage``'s (``damage.py``); listing the parts,
    checked for gaps, is ``self.listing``'s (``gaps.py``); the meta file is ``self.meta_file``
    (``meta.py``).
    """

    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.name = name
        self.files = Files.under(store.root, name)
        self.cache = PartCache()
        self.damage = Damage(store, name, self.files)
        self.listing = PartListing(self.damage)
        self.meta_file = MetaFile(store, self.files, self.damage, self.data_files)
        self.fence: Callable[[], None] | None = None

    def fenced(self) -> None:
        """Raise unless this writer may still write (see ``fence``)."""
        if self.fence is not None:
            self.fence()

    @property
    def url(self) -> str:
        return self.store.display(self.files.merged)

    # -- damaged files -------------------------------------------------------------------
    def set_aside(self, path: str, log: Logger | None = None) -> str:
        """Move the damaged file ``path`` into the quarantine folder (``Damage.set_aside``);
        returns where it went. Only the lock holder calls it."""
        self.fenced()
        to = self.damage.set_aside(path, log)
        self.listing.forget([path])
        return to

    def remove_stale_temporary(self) -> list[str]:
        """Delete temporary files of killed local writes older than ``STALE_TEMPORARY_SECONDS``
        (object stores write no temporary files); returns their paths."""
        if not self.store.local:
            return []
        return self.damage.remove_stale_temporary(self.list_files())

    # -- reading -------------------------------------------------------------------------
    def list_parts(
        self, listing: Iterable[FileInfo] | None = None
    ) -> tuple[list[Part], list[Part]]:
        """(live parts in sequence order, redundant parts that may be deleted).

        ``listing``: files already listed (a recursive listing of a folder above this
        checkpoint); without it the parts folder is listed.
        """
        return _split(self.listing.parts(listing))

    def parts_and_gaps(self, watermark: int, base_seq: int = 0) -> tuple[list[Part], list[Flushes]]:
        """(live parts, flushes above ``watermark`` that no part holds) after listing again
        while there is a gap (see ``gaps.py``); raises nothing about gaps."""
        listed, gaps = self.listing.checked(
            watermark, max(watermark + 1, base_seq), accept_gaps=True
        )
        return _split(listed)[0], gaps

    def read_file(self, path: str, data: bytes | None = None) -> pl.DataFrame:
        """One stored Parquet file (``data``, if already fetched); unreadable means corrupt."""
        try:
            raw = self.store.get(path) if data is None else data
        except FileNotFoundError:
            raise LockHeldError(
                f"Checkpoint file {self.store.display(path)} vanished while it was read: "
                f"another writer compacted or finalized {self.url} at the same time.",
                "Make sure one run writes each checkpoint; then run it again: it resumes from "
                "what is stored.",
            ) from None
        try:
            return parquet.decode(raw)
        except Exception as e:
            raise self.damage.unreadable(path, e) from e

    def read_merged(self) -> tuple[pl.DataFrame | None, int]:
        """The merged file's rows and watermark (``None, 0`` when there is none)."""
        raw = self.store.get_or_none(self.files.merged)
        if raw is None:
            return None, 0
        frame = self.read_file(self.files.merged, raw)  # reads the footer: watermark() can too
        return frame, parquet.watermark(raw)

    def merged_groups(self, base_seq: int = 0) -> Iterator[pl.DataFrame] | None:
        """The stored rows a row group of the merged file at a time, for a reader that needs
        no more than one row group in memory: None when parts are left to merge into them
        (``load`` resolves those). The file is fetched whole, so a finalize that replaces it
        meanwhile cannot mix two versions; an unreadable one raises as in ``load``."""
        live, redundant = self.list_parts()
        raw = None if live or redundant else self.store.get_or_none(self.files.merged)
        return None if raw is None else self._groups(raw, base_seq)

    def _groups(self, raw: bytes, base_seq: int) -> Iterator[pl.DataFrame]:
        try:
            for frame in parquet.decode_groups(raw):
                yield _since(frame, base_seq)
        except Exception as e:
            raise self.damage.unreadable(self.files.merged, e) from e

    def load(
        self,
        id_column: str,
        base_seq: int = 0,
        outputs: Sequence[str] | None = None,
        *,
        quarantine: Logger | None = None,
        accept_gaps: bool = False,
    ) -> Stored:
        """Read the merged file and every part above its watermark, resolved to one row per id.

        ``outputs``, the job's output columns when known, must be in every file with successes.
        ``quarantine``: the caller holds the lock. So an unreadable part is moved aside with a
        warning on this logger, and its rows count as not done. Without it, it raises. An
        unreadable merged file always raises (see ``damage.py``). A listing that leaves
        a gap in the sequence raises ``StorageError`` unless ``accept_gaps`` (``Stored.gaps``).
        """
        merged, watermark = self.read_merged()
        listed, gaps = self.listing.checked(
            watermark, max(watermark + 1, base_seq), accept_gaps=accept_gaps, log=quarantine
        )
        files = len(listed) + (merged is not None)
        frames_of: dict[str, pl.DataFrame] = {}
        moved: list[str] = []
        while True:  # again after a part is moved aside: parts it covered are live again
            live, redundant = _split(listed)
            parts = [p for p in live if p.last > watermark]
            # A part covered by another is read too. It is usually compaction's input, left by a
            # crash. But the part covering it may hold other rows: a run may have written it
            # under the same flush number, after a listing that missed this one.
            covered = [p for p in redundant if p.last > watermark]
            damaged = self._read_parts(
                parts + covered, base_seq, id_column, outputs, frames_of, quarantine
            )
            if damaged is None:
                break
            moved.append(self.set_aside(damaged.path, quarantine))
            listed.remove(damaged)
        leftover = [p for p in live if p.last <= watermark] + redundant
        if merged is not None and watermark >= base_seq:
            self.damage.check_file(merged, id_column, self.files.merged, outputs)
        else:
            merged = None  # none, or all of an earlier generation
        read = [frames_of[p.path] for p in parts + covered if p.path in frames_of]
        stored = _resolved(merged, read, base_seq, id_column, self.url)
        highest = max([watermark, *(p.last for p in parts)])
        return Stored(stored, watermark, highest + 1, parts, leftover, files, moved, gaps)

    def _read_parts(
        self,
        parts: list[Part],
        base_seq: int,
        id_column: str,
        outputs: Sequence[str] | None,
        frames_of: dict[str, pl.DataFrame],
        quarantine: Logger | None,
    ) -> Part | None:
        """Read ``parts`` not read yet into ``frames_of``; the first unreadable one, when the
        caller may move it aside (else its error is raised)."""
        for part in parts:
            if part.last < base_seq or part.path in frames_of:
                continue
            frame = self.cache.get(part.path)
            if frame is None:
                try:
                    frame = self.read_file(part.path)
                except CorruptCheckpointError:
                    if quarantine is None:
                        raise
                    return part
                self.damage.check_file(frame, id_column, part.path, outputs)
            frames_of[part.path] = frame
        return None

    # -- writing -------------------------------------------------------------------------
    def write_part(
        self,
        frame: pl.DataFrame,
        first: int,
        last: int | None = None,
        *,
        data: bytes | None = None,
        id_column: str | None = None,
    ) -> Part:
        """Write ``frame`` (``_seq`` already set) as the part covering ``first``..``last``.

        ``data``: the rows as ``encode_part`` gave them, when the caller encoded them already.
        ``id_column``: the ids, encoded as ids (see ``encode_part``).
        """
        last = first if last is None else last
        path = self.files.new_part(first, last)
        if data is None:
            data = self.encode_part(frame, id_column)
        self.fenced()
        self.store.put(path, data)
        self.cache.remember(path, frame)
        part = Part(path, first, last, len(data))
        self.listing.wrote(part)
        return part

    @staticmethod
    def encode_part(frame: pl.DataFrame, id_column: str | None = None) -> bytes:
        """The Parquet bytes of a part holding ``frame``; integer ids are delta-encoded when
        ``id_column`` is given (a quarter smaller, and cheaper to write)."""
        distinct = [id_column] if id_column else []
        return parquet.encode(frame, part=True, distinct=distinct, hashes=[INPUT_HASH])

    def compact(self, parts: list[Part], id_column: str) -> list[Part]:
        """Merge runs of same-level parts while too many exist (see ``compaction.py``).

        Returns the live parts afterwards. Safe to interrupt at any point.
        """
        parts = list(parts)
        while (start := mergeable_run(parts)) is not None:
            run = parts[start : start + COMPACT_FANOUT]
            frames = [self.cache.take(p.path) for p in run]
            pairs = zip(frames, run, strict=True)
            merged = rows.concat(
                [f if f is not None else self.read_file(p.path) for f, p in pairs], self.url
            ).rechunk()  # one chunk: a part made of thousands of tiny ones is slow to use
            winners = rows.pick_winners(merged, id_column)
            part = self.write_part(winners, run[0].first, run[-1].last, id_column=id_column)
            self._delete(run)
            parts[start : start + COMPACT_FANOUT] = [part]
        return parts

    def finalize(
        self,
        id_column: str,
        current_ids: pl.Series | None,
        base_seq: int = 0,
        known: Stored | None = None,
        tail: pl.DataFrame | None = None,
    ) -> pl.DataFrame:
        """Merge every part into ``<name>.parquet`` and delete them; returns the stored rows.

        ``current_ids`` (the ids of this run's input) marks which rows form the result; rows
        outside it stay stored with ``_current`` false. ``None`` keeps the previous marks.
        ``known`` is what ``load`` returned to a writer that has written nothing since: it spares
        reading everything again. ``tail``: the writer's last rows (``_seq`` set, above every
        stored one), merged in without being written as a part first. A checkpoint whose rows
        and marks are unchanged (a resume with nothing left to do) is not rewritten.
        """
        stored = known if known is not None else self.load(id_column, base_seq)
        final = merged_rows(stored, id_column, current_ids, base_seq, tail, self.url)
        if final.changed:
            watermarked = {parquet.WATERMARK_KEY: str(final.watermark)}
            data = parquet.encode(
                final.rows, watermarked, distinct=[id_column], hashes=[INPUT_HASH]
            )
            self.fenced()
            self.store.put(self.files.merged, data)
        # Everything this load saw is now merged: delete it without listing again.
        self._delete([*stored.parts, *stored.leftover])
        self.cache.clear()
        self.remove_stale_temporary()
        return final.rows

    def _delete(self, parts: Sequence[Part]) -> None:
        self.fenced()
        self.store.delete(p.path for p in parts)
        self.listing.forget(p.path for p in parts)

    def data_files(self) -> list[str]:
        """Paths of the merged file (if any) and of every part file, merged ones included."""
        listed = self.list_files()
        merged = [f.path for f in listed if f.path == self.files.merged]
        return merged + [p.path for p in self.listing.parts(listed)]

    def list_files(self) -> list[FileInfo]:
        """Every file of this checkpoint: merged, meta, lock, parts and quarantined files."""
        folder = self.files.merged.rsplit("/", 1)[0]
        found = [f for f in self.store.list(folder) if self.files.owns(f.path)]
        return found + self.store.list(self.files.parts) + self.store.list(self.files.quarantine)

    # -- result --------------------------------------------------------------------------
    def read_result(
        self, id_column: str, output_columns: Sequence[str] | None, *, meta: Meta | None = None
    ) -> pl.DataFrame:
        """The result a downstream asset sees: id, output columns and ``_error``.

        ``meta``: the checkpoint's meta when the caller has read it already.
        """
        meta = meta if meta is not None else self.meta_file.read()
        base_seq = meta.base_seq if meta else 0
        frame = self.load(id_column, base_seq).rows
        if CURRENT in frame.columns:
            frame = frame.filter(pl.col(CURRENT).fill_null(True))
        keep = [id_column, *(output_columns or rows.outputs_of(frame, id_column)), ERROR]
        return frame.select([c for c in keep if c in frame.columns])


@dataclass(frozen=True)
class Merged:
    """What ``finalize`` stores: every row, marked current or not, the highest flush they hold,
    and whether they differ from the merged file stored."""

    rows: pl.DataFrame
    watermark: int
    changed: bool


def merged_rows(
    stored: Stored,
    id_column: str,
    current_ids: pl.Series | None,
    base_seq: int,
    tail: pl.DataFrame | None,
    url: str,
) -> Merged:
    """``stored`` and the writer's ``tail`` as the merged file holds them (see ``finalize``)."""
    frame = stored.rows
    changed = bool(stored.parts) or stored.watermark < base_seq
    watermark = stored.next_seq - 1
    if tail is not None and tail.height:
        merged = rows.concat([frame, tail], url) if frame.height else tail
        frame = rows.pick_winners(merged, id_column)
        watermark = max(watermark, int(tail.get_column(SEQ).max()))  # type: ignore[arg-type]
        changed = True
    if current_ids is not None:
        before = frame.get_column(CURRENT) if CURRENT in frame.columns else None
        frame = frame.with_columns(_marks(frame.get_column(id_column), current_ids))
        changed = changed or before is None or not before.equals(frame.get_column(CURRENT))
        if current_ids.is_sorted() and not frame.get_column(id_column).is_sorted():
            # Store rows in the input's order, so that resumes match ids by a sorted merge.
            frame = frame.sort(id_column)
            changed = True
    elif CURRENT in frame.columns:
        frame = frame.with_columns(pl.col(CURRENT).fill_null(True))
    else:
        frame = frame.with_columns(pl.lit(True).alias(CURRENT))
    return Merged(frame, watermark, changed)


def _resolved(
    merged: pl.DataFrame | None,
    parts: list[pl.DataFrame],
    base_seq: int,
    id_column: str,
    url: str,
) -> pl.DataFrame:
    """The rows of the generation from ``base_seq``, one per id: the merged file's (checked,
    None when it holds none of them) and the parts'."""
    frames = [] if merged is None else [_since(merged, base_seq)]
    frames += [_since(frame, base_seq) for frame in parts]
    stored = rows.concat(frames, url) if frames else rows.empty(id_column)
    if len(frames) > 1 or merged is None:
        stored = rows.pick_winners(stored, id_column)  # the merged file alone was checked
    return stored


def _split(parts: list[Part]) -> tuple[list[Part], list[Part]]:
    """(live, redundant) of parts in sequence order: a part covered by a larger one written
    before a crash (compaction's output) is redundant."""
    live: list[Part] = []
    redundant: list[Part] = []
    for part in parts:
        if live and part.last <= live[-1].last:
            redundant.append(part)
        else:
            live.append(part)
    return live, redundant


def _since(frame: pl.DataFrame, base_seq: int) -> pl.DataFrame:
    """Rows of flushes ``base_seq`` and later (every row when the generation began at 0)."""
    return frame if base_seq <= 0 else frame.filter(pl.col(SEQ) >= base_seq)


def _marks(ids: pl.Series, current_ids: pl.Series) -> pl.Expr:
    """``_current`` for each stored id: is it in this run's input?

    An expression, not a Series. A new Series of one chunk, beside columns read in many, would
    make the next ``select`` copy every column into one chunk.
    """
    if ids.equals(current_ids):  # stored in the input's order: every row is current
        return pl.lit(True).alias(CURRENT)
    return pl.col(ids.name).is_in(current_ids.implode()).alias(CURRENT)
