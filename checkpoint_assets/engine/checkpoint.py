"""One checkpoint on storage: its files (see ``layout.py``), read, merged, compacted, finalized.

Sequence numbers order everything. A flush takes the next number after the highest one on storage
(the merged file's watermark or any part's ``<last>``), so the order survives restarts and never
depends on clocks. The merged file records, inside its own Parquet metadata, the highest sequence
it contains (the watermark): parts at or below it are already merged. That makes finalize
crash-safe with a single atomic write: merge, write ``<name>.parquet`` (atomic), then delete the
merged parts; a crash between the two leaves parts that readers skip and the next writer deletes.

Rows are resolved per id by the rule of ``rows.py``; compaction is described in
``compaction.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import polars as pl

from checkpoint_assets.engine import parquet, rows
from checkpoint_assets.engine.compaction import COMPACT_FANOUT, Part, PartCache, mergeable_run
from checkpoint_assets.engine.errors import CorruptCheckpointError
from checkpoint_assets.engine.layout import Files, part_range
from checkpoint_assets.engine.meta import Meta
from checkpoint_assets.engine.rows import CURRENT, ERROR, SEQ
from checkpoint_assets.engine.storage import FileInfo, Store

# A file that cannot be read is no sign of two jobs sharing a checkpoint: say what to do instead.
_UNREADABLE = (
    "Move it aside to keep its rows for inspection, then run again: the rows it held are "
    "computed again. `checkpoint-assets verify` lists every problem of a checkpoint."
)


@dataclass
class Stored:
    """Everything a checkpoint holds, resolved to one winning row per id."""

    rows: pl.DataFrame
    watermark: int
    next_seq: int
    parts: list[Part]  # live, unmerged parts
    leftover: list[Part] = field(default_factory=list)  # merged or covered, not yet deleted


class Checkpoint:
    """The files of one checkpoint under a store. Readers need no lock; writers hold one."""

    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.name = name
        self.files = Files.under(store.root, name)
        self.cache = PartCache()

    @property
    def url(self) -> str:
        return self.store.display(self.files.merged)

    # -- meta ----------------------------------------------------------------------------
    def read_meta(self) -> Meta | None:
        data = self.store.get_or_none(self.files.meta)
        return None if data is None else Meta.from_json(data, self.store.display(self.files.meta))

    def write_meta(self, meta: Meta) -> None:
        self.store.put(self.files.meta, meta.to_json())

    # -- reading -------------------------------------------------------------------------
    def list_parts(
        self, listing: Iterable[FileInfo] | None = None
    ) -> tuple[list[Part], list[Part]]:
        """(live parts in sequence order, redundant parts that may be deleted).

        ``listing``: files already listed (a recursive listing of a folder above this
        checkpoint); without it the parts folder is listed.
        """
        if listing is None:
            listing = self.store.list(self.files.parts)
        parts: list[Part] = []
        for info in listing:
            found = part_range(info.name)
            # Temporary files of an interrupted local write, or other folders' files, are not parts.
            if found and info.path.rsplit("/", 1)[0] == self.files.parts:
                parts.append(Part(info.path, found[0], found[1], info.size))
        parts.sort(key=lambda p: (p.first, -p.last))
        live: list[Part] = []
        redundant: list[Part] = []
        for part in parts:
            if live and part.last <= live[-1].last:
                redundant.append(part)  # covered by a compacted part written before a crash
            else:
                live.append(part)
        return live, redundant

    def read_file(self, path: str, data: bytes | None = None) -> pl.DataFrame:
        """One stored Parquet file (``data``, if already fetched); unreadable means corrupt."""
        raw = self.store.get(path) if data is None else data
        try:
            return parquet.decode(raw)
        except Exception as e:
            where = self.store.display(path)
            raise CorruptCheckpointError(where, f"is unreadable ({e})", _UNREADABLE) from e

    def read_merged(self) -> tuple[pl.DataFrame | None, int]:
        """The merged file's rows and watermark (``None, 0`` when there is none)."""
        raw = self.store.get_or_none(self.files.merged)
        if raw is None:
            return None, 0
        return self.read_file(self.files.merged, raw), parquet.watermark(raw)

    def load(
        self, id_column: str, base_seq: int = 0, outputs: Sequence[str] | None = None
    ) -> Stored:
        """Read the merged file and every live part, resolved to one row per id.

        ``outputs``, the job's output columns when known, must be in every file with successes.
        """
        merged, watermark = self.read_merged()
        listed, redundant = self.list_parts()
        parts = [p for p in listed if p.last > watermark]
        leftover = [p for p in listed if p.last <= watermark] + redundant
        frames: list[pl.DataFrame] = []
        use_merged = merged is not None and watermark >= base_seq
        if merged is not None and use_merged:
            self.check_file(merged, id_column, self.files.merged, outputs)
            frames.append(_since(merged, base_seq))
        for part in parts:
            if part.last < base_seq:
                continue
            frame = self.cache.get(part.path)
            if frame is None:
                frame = self.read_file(part.path)
                self.check_file(frame, id_column, part.path, outputs)
            frames.append(_since(frame, base_seq))
        highest = max([watermark, *(p.last for p in parts)])
        stored = rows.concat(frames, self.url) if frames else rows.empty(id_column)
        if len(frames) > 1 or not use_merged:
            stored = rows.pick_winners(stored, id_column)  # the merged file alone was checked
        return Stored(stored, watermark, highest + 1, parts, leftover)

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

    # -- writing -------------------------------------------------------------------------
    def write_part(
        self, frame: pl.DataFrame, first: int, last: int | None = None, *, data: bytes | None = None
    ) -> Part:
        """Write ``frame`` (``_seq`` already set) as the part covering ``first``..``last``.

        ``data``: the rows as ``encode_part`` gave them, when the caller encoded them already.
        """
        last = first if last is None else last
        path = self.files.new_part(first, last)
        if data is None:
            data = self.encode_part(frame)
        self.store.put(path, data)
        self.cache.remember(path, frame)
        return Part(path, first, last, len(data))

    @staticmethod
    def encode_part(frame: pl.DataFrame) -> bytes:
        """The Parquet bytes of a part holding ``frame``."""
        return parquet.encode(frame, part=True)

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
            part = self.write_part(rows.pick_winners(merged, id_column), run[0].first, run[-1].last)
            self.store.delete(p.path for p in run)
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
        frame = stored.rows
        changed = bool(stored.parts) or stored.watermark < base_seq
        watermark = stored.next_seq - 1
        if tail is not None and tail.height:
            merged = rows.concat([frame, tail], self.url) if frame.height else tail
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
        if changed:
            data = parquet.encode(frame, {parquet.WATERMARK_KEY: str(watermark)})
            self.store.put(self.files.merged, data)
        # Everything this load saw is now merged: delete it without listing again.
        self.store.delete(p.path for p in [*stored.parts, *stored.leftover])
        self.cache.clear()
        return frame

    def list_files(self) -> list[FileInfo]:
        """Every file of this checkpoint: merged, meta, lock and parts."""
        folder = self.files.merged.rsplit("/", 1)[0]
        found = [f for f in self.store.list(folder) if self.files.owns(f.path)]
        return found + self.store.list(self.files.parts)

    # -- result --------------------------------------------------------------------------
    def read_result(
        self, id_column: str, output_columns: Sequence[str] | None, *, meta: Meta | None = None
    ) -> pl.DataFrame:
        """The result a downstream asset sees: id, output columns and ``_error``.

        ``meta``: the checkpoint's meta when the caller has read it already.
        """
        meta = meta if meta is not None else self.read_meta()
        base_seq = meta.base_seq if meta else 0
        frame = self.load(id_column, base_seq).rows
        if CURRENT in frame.columns:
            frame = frame.filter(pl.col(CURRENT).fill_null(True))
        keep = [id_column, *(output_columns or rows.outputs_of(frame, id_column)), ERROR]
        return frame.select([c for c in keep if c in frame.columns])


def _since(frame: pl.DataFrame, base_seq: int) -> pl.DataFrame:
    """Rows of flushes ``base_seq`` and later (every row when the generation began at 0)."""
    return frame if base_seq <= 0 else frame.filter(pl.col(SEQ) >= base_seq)


def _marks(ids: pl.Series, current_ids: pl.Series) -> pl.Expr:
    """``_current`` for each stored id: is it in this run's input?

    An expression, not a Series: a new Series of one chunk beside columns read in many would make
    the next ``select`` copy every column into one chunk.
    """
    if ids.equals(current_ids):  # stored in the input's order: every row is current
        return pl.lit(True).alias(CURRENT)
    return pl.col(ids.name).is_in(current_ids.implode()).alias(CURRENT)
