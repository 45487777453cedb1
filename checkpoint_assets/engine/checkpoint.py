"""One checkpoint on storage: its files, how they are read, merged, compacted and finalized.

Layout, for a checkpoint named ``<name>`` (SPEC section 2)::

    <name>.parquet                     merged result of all finalized work
    <name>.parquet.parts/part-<first>-<last>-<uuid>.parquet
                                       unmerged rows of flushes <first>..<last>
    <name>.parquet.meta.json           job and input fingerprints, scheme, schema
    <name>.parquet.lock                the single writer's lease (see ``lock.py``)

Every stored row carries the id, the output columns and five bookkeeping columns:
``_error`` (null on success), ``_attempts``, ``_input_hash`` (see ``hashing.py``), ``_seq`` (the
flush that wrote it) and, in the merged file, ``_current`` (false for rows that were absent from
the input at the last finalize; kept, never lost, but not part of the result).

Sequence numbers order everything. A flush takes the next number after the highest one on storage
(the merged file's watermark or any part's ``<last>``), so the order survives restarts and never
depends on clocks. The merged file records, inside its own Parquet metadata, the highest sequence
it contains (the watermark): parts at or below it are already merged. That makes finalize crash-safe
with a single atomic write: merge, write ``<name>.parquet`` (atomic), then delete the merged parts;
a crash between the two leaves parts that readers skip and the next writer deletes.

Compaction keeps the number of parts bounded while a run flushes: once 56 parts exist, eight
consecutive parts of the same size class are merged into one part covering their range
(size-tiered, as in a log-structured merge tree), so a run never holds more than 64 parts and each
row is rewritten only a logarithmic number of times. Short runs are not compacted at all: finalize
merges their parts once. A part covered by a larger one (a crash after the
compacted part was written but before its inputs were deleted) is skipped by readers.

The winner among several stored rows of one id: the input hash of the id's newest row is the id's
current input; among the rows with that hash a success beats a failure, then the newest wins. When
the input never changes this is exactly "success beats failure, then newest".
"""

from __future__ import annotations

import io
import json
import logging
import math
import posixpath
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from checkpoint_assets.engine.errors import CheckpointError, CorruptCheckpointError
from checkpoint_assets.engine.storage import FileInfo, Store

log = logging.getLogger("checkpoint_assets")

ERROR = "_error"
ATTEMPTS = "_attempts"
INPUT_HASH = "_input_hash"
SEQ = "_seq"
CURRENT = "_current"
BOOKKEEPING = (ERROR, ATTEMPTS, INPUT_HASH, SEQ, CURRENT)

FORMAT_VERSION = 1
COMPACT_FANOUT = 8
RECENT_BYTES = 256 * 2**20
COMPACT_AT = 56  # compaction starts here, so a run never holds more than 64 unmerged parts
_WATERMARK_KEY = "checkpoint_assets.watermark"
_PART = re.compile(r"^part-(\d+)-(\d+)-[0-9a-f]+\.parquet$")


@dataclass
class Meta:
    """The content of ``<name>.parquet.meta.json``."""

    job_fingerprint: str
    job: dict[str, Any]
    id_column: str
    id_dtype: str
    output_schema: dict[str, str] | None = None
    scheme: dict[str, Any] | None = None
    base_seq: int = 0
    input_fingerprint: str | None = None
    rows: dict[str, int] = field(default_factory=dict)
    finalized_at: float | None = None
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Meta:
        try:
            raw = json.loads(data)
            return cls(**raw)
        except (ValueError, TypeError) as e:
            raise CorruptCheckpointError(
                f"Checkpoint metadata {where} is unreadable ({e}). If it was edited by hand, "
                "restore it; otherwise start over with `resume: false` or a new checkpoint_tag."
            ) from e


@dataclass(frozen=True)
class Part:
    """An unmerged part file covering flushes ``first``..``last``."""

    path: str
    first: int
    last: int
    size: int

    @property
    def span(self) -> int:
        return self.last - self.first + 1

    @property
    def level(self) -> int:
        return int(math.log(self.span, COMPACT_FANOUT) + 1e-9)


@dataclass
class Stored:
    """Everything a checkpoint holds, resolved to one winning row per id."""

    rows: pl.DataFrame
    watermark: int
    next_seq: int
    parts: list[Part]  # live, unmerged parts
    leftover: list[Part] = field(default_factory=list)  # merged or covered, not yet deleted


def _empty_rows() -> pl.DataFrame:
    return pl.DataFrame(
        schema={ERROR: pl.String, ATTEMPTS: pl.Int32, INPUT_HASH: pl.UInt64, SEQ: pl.Int64}
    )


def pick_winners(rows: pl.DataFrame, id_column: str) -> pl.DataFrame:
    """One row per id by the rule in the module docstring; ``_seq`` becomes the id's newest."""
    if rows.height == 0 or distinct_count(rows.get_column(id_column)) == rows.height:
        return rows
    by_id = pl.col(id_column)
    return (
        rows.sort(SEQ)
        .with_columns(
            pl.col(INPUT_HASH).last().over(by_id).alias("__hash"),
            pl.col(SEQ).last().over(by_id).alias("__newest"),
        )
        .filter(pl.col(INPUT_HASH) == pl.col("__hash"))
        .sort([pl.col(ERROR).is_null(), pl.col(SEQ)])
        .unique(subset=[id_column], keep="last", maintain_order=True)
        .with_columns(pl.col("__newest").alias(SEQ))
        .drop("__hash", "__newest")
    )


class Checkpoint:
    """The files of one checkpoint under a store. Readers need no lock; writers hold one."""

    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.name = name
        self.merged_path = store.path(f"{name}.parquet")
        self.parts_dir = store.path(f"{name}.parquet.parts")
        self.meta_path = store.path(f"{name}.parquet.meta.json")
        self.lock_path = store.path(f"{name}.parquet.lock")
        # Parts this process wrote, kept (up to RECENT_BYTES) to merge them without reading them
        # back: memory stays bounded whatever the outputs' size.
        self._recent: dict[str, pl.DataFrame] = {}
        self._recent_bytes = 0.0

    @property
    def url(self) -> str:
        return self.store.display(self.merged_path)

    # -- meta ----------------------------------------------------------------------------
    def read_meta(self) -> Meta | None:
        data = self.store.get_or_none(self.meta_path)
        return None if data is None else Meta.from_json(data, self.store.display(self.meta_path))

    def write_meta(self, meta: Meta) -> None:
        self.store.put(self.meta_path, meta.to_json())

    # -- reading -------------------------------------------------------------------------
    def list_parts(
        self, listing: Iterable[FileInfo] | None = None
    ) -> tuple[list[Part], list[Part]]:
        """(live parts in sequence order, redundant parts that may be deleted).

        ``listing``: files already listed (a recursive listing of a folder above this
        checkpoint); without it the parts folder is listed.
        """
        if listing is None:
            listing = self.store.list(self.parts_dir)
        else:
            listing = [f for f in listing if posixpath.dirname(f.path) == self.parts_dir]
        parts: list[Part] = []
        for info in listing:
            match = _PART.match(info.name)
            if match:  # temporary files of an interrupted local write are not parts
                parts.append(Part(info.path, int(match[1]), int(match[2]), info.size))
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
            return _read_frame(raw)
        except Exception as e:
            raise CorruptCheckpointError(
                f"Checkpoint file {self.store.display(path)} is unreadable ({e}). Move it aside "
                "to keep its rows for inspection, then run again: the rows it held are computed "
                "again. `checkpoint-assets verify` lists every problem of a checkpoint."
            ) from e

    def read_merged(self) -> tuple[pl.DataFrame | None, int]:
        """The merged file's rows and watermark (``None, 0`` when there is none)."""
        raw = self.store.get_or_none(self.merged_path)
        if raw is None:
            return None, 0
        rows = self.read_file(self.merged_path, raw)
        meta = pl.read_parquet_metadata(raw)
        return rows, int(meta.get(_WATERMARK_KEY, "0"))

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
            self.check_file(merged, id_column, self.merged_path, outputs)
            frames.append(_since(merged, base_seq))
        for part in parts:
            if part.last < base_seq:
                continue
            frame = self._recent.get(part.path)
            if frame is None:
                frame = self.read_file(part.path)
                self.check_file(frame, id_column, part.path, outputs)
            frames.append(_since(frame, base_seq))
        highest = max([watermark, *(p.last for p in parts)])
        # Nothing stored yet (an empty shard, an outage on the first call) still has an id column.
        empty = _empty_rows().with_columns(pl.lit(None).alias(id_column))
        rows = _concat(frames, id_column) if frames else empty
        if len(frames) > 1 or not use_merged:
            rows = pick_winners(rows, id_column)  # the merged file alone was checked just above
        return Stored(rows, watermark, highest + 1, parts, leftover)

    def check_file(
        self, rows: pl.DataFrame, id_column: str, path: str, outputs: Sequence[str] | None = None
    ) -> None:
        """Raise ``CorruptCheckpointError`` unless the file at ``path`` (holding ``rows``) has the
        id column, unique ids and, where it holds successes, the ``outputs``."""
        missing = [c for c in outputs or () if c not in rows.columns]
        if missing and ERROR in rows.columns and rows.get_column(ERROR).is_null().any():
            raise CorruptCheckpointError(
                f"Checkpoint file {self.store.display(path)} holds results without the output "
                f"columns {missing} (it has {rows.columns}). Two different jobs probably share "
                "this checkpoint: give each its own checkpoint_tag, or start over with "
                "`resume: false`."
            )
        if id_column not in rows.columns:
            raise CorruptCheckpointError(
                f"Checkpoint file {self.store.display(path)} has no id column {id_column!r} "
                f"(it has {rows.columns}). Two different jobs probably share this checkpoint: "
                "give this asset its own checkpoint_tag, or start over with `resume: false`."
            )
        ids = rows.get_column(id_column)
        if distinct_count(ids) != rows.height:
            dupes = ids.filter(ids.is_duplicated()).unique().head(5).to_list()
            raise CorruptCheckpointError(
                f"Checkpoint file {self.store.display(path)} holds duplicate ids {dupes}. A "
                "checkpoint written by this package never does; two jobs probably share this "
                "checkpoint. Give each job its own checkpoint_tag, or start over with "
                "`resume: false`."
            )

    # -- writing -------------------------------------------------------------------------
    def write_part(
        self, rows: pl.DataFrame, first: int, last: int | None = None, *, data: bytes | None = None
    ) -> Part:
        """Write ``rows`` (``_seq`` already set) as the part covering ``first``..``last``.

        ``data``: the rows as ``encode_part`` gave them, when the caller encoded them already.
        """
        last = first if last is None else last
        name = f"part-{first:012d}-{last:012d}-{uuid.uuid4().hex[:12]}.parquet"
        path = posixpath.join(self.parts_dir, name)
        if data is None:
            data = self.encode_part(rows)
        self.store.put(path, data)
        self._remember(path, rows)
        return Part(path, first, last, len(data))

    @staticmethod
    def encode_part(rows: pl.DataFrame) -> bytes:
        """The Parquet bytes of a part holding ``rows``."""
        return _to_parquet(rows, part=True)

    @staticmethod
    def check_storable(sample: pl.DataFrame) -> None:
        """Raise a clear error if parts or the merged file cannot store a column of ``sample``.

        Int128 fails to encode; an Object column would become the bytes of Python pointers in a
        part, and fails in the merged file. Checked on a run's first result, before any flush.
        """
        if pl.Object not in sample.schema.values():
            try:
                _to_parquet(sample, part=True)
                _to_parquet(sample)
                return
            except Exception:  # find the columns, to name them
                pass
        bad: dict[str, str] = {}
        for column in sample.columns:
            one = sample.select(column)
            if one.schema[column] == pl.Object:
                bad[column] = "Object (Python objects)"
                continue
            try:
                _to_parquet(one, part=True)
                _to_parquet(one)
            except Exception as e:
                bad[column] = f"{one.schema[column]} ({e})"
        if bad:
            raise CheckpointError(
                "The function returns columns that a Parquet checkpoint cannot store: "
                + "; ".join(f"{c}: {why}" for c, why in bad.items())
                + ". Cast them in the function (to Int64, Float64 or String, for example)."
            )

    def _remember(self, path: str, rows: pl.DataFrame) -> None:
        self._recent[path] = rows
        self._recent_bytes += rows.estimated_size()
        while self._recent_bytes > RECENT_BYTES and len(self._recent) > 1:
            oldest = next(iter(self._recent))
            self._recent_bytes -= self._recent.pop(oldest).estimated_size()

    def _recall(self, path: str) -> pl.DataFrame | None:
        rows = self._recent.pop(path, None)
        if rows is not None:
            self._recent_bytes -= rows.estimated_size()
        return rows

    def compact(self, parts: list[Part], id_column: str) -> list[Part]:
        """Merge runs of ``COMPACT_FANOUT`` same-level parts while more than ``COMPACT_AT`` exist.

        Compacting only near the cap leaves short runs alone (finalize merges their parts once)
        and keeps long ones under 64 parts. Parts stay ordered from the largest level to the
        smallest, so once ``COMPACT_AT`` parts exist some level has a run of eight to merge.
        Returns the live parts afterwards. Safe to interrupt at any point (see module doc).
        """
        parts = list(parts)
        while len(parts) >= COMPACT_AT:
            start = _mergeable_run(parts)
            if start is None:
                break
            run = parts[start : start + COMPACT_FANOUT]
            frames = [self._recall(p.path) for p in run]
            pairs = zip(frames, run, strict=True)
            rows = _concat(
                [f if f is not None else self.read_file(p.path) for f, p in pairs], id_column
            ).rechunk()  # one chunk: a part made of thousands of tiny ones is slow to use
            merged = self.write_part(pick_winners(rows, id_column), run[0].first, run[-1].last)
            self.store.delete(p.path for p in run)
            parts[start : start + COMPACT_FANOUT] = [merged]
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
        rows = stored.rows
        changed = bool(stored.parts) or stored.watermark < base_seq
        watermark = stored.next_seq - 1
        if tail is not None and tail.height:
            merged = _concat([rows, tail], id_column) if rows.height else tail
            rows = pick_winners(merged, id_column)
            watermark = max(watermark, int(tail.get_column(SEQ).max()))  # type: ignore[arg-type]
            changed = True
        if current_ids is not None:
            before = rows.get_column(CURRENT) if CURRENT in rows.columns else None
            rows = rows.with_columns(_marks(rows.get_column(id_column), current_ids))
            changed = changed or before is None or not before.equals(rows.get_column(CURRENT))
            if current_ids.is_sorted() and not rows.get_column(id_column).is_sorted():
                # Store rows in the input's order, so that resumes match ids by a sorted merge.
                rows = rows.sort(id_column)
                changed = True
        elif CURRENT in rows.columns:
            rows = rows.with_columns(pl.col(CURRENT).fill_null(True))
        else:
            rows = rows.with_columns(pl.lit(True).alias(CURRENT))
        if changed:
            data = _to_parquet(rows, {_WATERMARK_KEY: str(watermark)})
            self.store.put(self.merged_path, data)
        # Everything this load saw is now merged: delete it without listing again.
        self.store.delete(p.path for p in [*stored.parts, *stored.leftover])
        self._recent.clear()
        self._recent_bytes = 0.0
        return rows

    # -- result --------------------------------------------------------------------------
    def read_result(
        self,
        id_column: str,
        output_columns: Sequence[str] | None,
        *,
        meta: Meta | None = None,
    ) -> pl.DataFrame:
        """The result a downstream asset sees: id, output columns and ``_error``.

        ``meta``: the checkpoint's meta when the caller has read it already.
        """
        meta = meta if meta is not None else self.read_meta()
        base_seq = meta.base_seq if meta else 0
        rows = self.load(id_column, base_seq).rows
        if CURRENT in rows.columns:
            rows = rows.filter(pl.col(CURRENT).fill_null(True))
        keep = [id_column, *(output_columns or _outputs(rows, id_column)), ERROR]
        return rows.select([c for c in keep if c in rows.columns])

    def files(self) -> Iterable[FileInfo]:
        """Every file of this checkpoint (for status and size reports)."""
        folder = posixpath.dirname(self.merged_path)
        base = posixpath.basename(self.merged_path)
        for info in self.store.list(folder):
            if info.name.startswith(base):
                yield info
        yield from self.store.list(self.parts_dir)


def resolve(frames: list[pl.DataFrame], id_column: str) -> pl.DataFrame:
    """The stored rows of several files, one winning row per id (see ``pick_winners``)."""
    return pick_winners(_concat(frames, id_column), id_column)


def distinct_count(values: pl.Series) -> int:
    """How many distinct values; sorted ones (ids stored in input order) need no hash table."""
    if values.is_sorted():
        values = values.set_sorted()
    return values.n_unique()


def _read_frame(raw: bytes) -> pl.DataFrame:
    """A Parquet file as a DataFrame, each column that is null in every row as a constant.

    Polars gives every string value a 16-byte view, nulls included: the ``_error`` column of 10**7
    successful rows would take 160 MB, a constant takes nothing. The null counts come from the
    file's column statistics; a file without them is read as it is.
    """
    empty = _all_null_columns(raw)
    if not empty:
        return pl.read_parquet(io.BytesIO(raw))
    schema = pl.read_parquet_schema(io.BytesIO(raw))
    frame = pl.read_parquet(io.BytesIO(raw), columns=[c for c in schema if c not in empty])
    nulls = [pl.lit(None, schema[c]).alias(c) for c in empty]
    return frame.with_columns(nulls).select(list(schema))


def _all_null_columns(raw: bytes) -> set[str]:
    meta = pq.ParquetFile(pa.BufferReader(raw)).metadata
    flat = {f.name for f in meta.schema.to_arrow_schema() if not pa.types.is_nested(f.type)}
    nulls = dict.fromkeys(flat, 0)
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for i in range(group.num_columns):
            column = group.column(i)
            if column.path_in_schema not in nulls:
                continue
            stats = column.statistics
            known = stats is not None and stats.has_null_count
            nulls[column.path_in_schema] += stats.null_count if known else -(meta.num_rows + 1)
    empty = {c for c, n in nulls.items() if n == meta.num_rows > 0}
    return empty if len(empty) < len(meta.schema.to_arrow_schema()) else set()


def _since(rows: pl.DataFrame, base_seq: int) -> pl.DataFrame:
    """Rows of flushes ``base_seq`` and later (every row when the generation began at 0)."""
    return rows if base_seq <= 0 else rows.filter(pl.col(SEQ) >= base_seq)


def _marks(ids: pl.Series, current_ids: pl.Series) -> pl.Expr:
    """``_current`` for each stored id: is it in this run's input?

    An expression, not a Series: a new Series of one chunk beside columns read in many would make
    the next ``select`` copy every column into one chunk.
    """
    if ids.equals(current_ids):  # stored in the input's order: every row is current
        return pl.lit(True).alias(CURRENT)
    return pl.col(ids.name).is_in(current_ids.implode()).alias(CURRENT)


def _outputs(rows: pl.DataFrame, id_column: str) -> list[str]:
    return [c for c in rows.columns if c != id_column and c not in BOOKKEEPING]


def _concat(frames: list[pl.DataFrame], id_column: str) -> pl.DataFrame:
    if len(frames) == 1:
        return frames[0]
    try:
        return pl.concat(frames, how="diagonal_relaxed")
    except Exception as e:
        raise CorruptCheckpointError(
            f"Checkpoint files disagree on their columns or types ({e}). Two different jobs "
            "probably share this checkpoint: give each its own checkpoint_tag, or start over "
            "with `resume: false`."
        ) from e


def _mergeable_run(parts: Sequence[Part]) -> int | None:
    """Index of the oldest run of ``COMPACT_FANOUT`` consecutive parts of the lowest level.

    Merging the oldest run of a level puts the merged part right after the parts of the next
    level up, which keeps parts ordered from the largest level to the smallest.
    """
    for level in sorted({p.level for p in parts}):
        count = 0
        for i, part in enumerate(parts):
            count = count + 1 if part.level == level else 0
            if count == COMPACT_FANOUT:
                return i - COMPACT_FANOUT + 1
    return None


def _to_parquet(
    rows: pl.DataFrame, metadata: dict[str, str] | None = None, *, part: bool = False
) -> bytes:
    """Parquet bytes.

    Parts live briefly and are written on the hot path, once per flush: pyarrow writes them
    with lz4 and without statistics or dictionaries, in about half the time polars takes for a
    small frame (its fixed cost per file dominates parts of a few rows).
    """
    buffer = io.BytesIO()
    if part:
        pq.write_table(
            rows.to_arrow(),
            buffer,
            compression="lz4",
            use_dictionary=False,
            write_statistics=False,
        )
    else:
        rows.write_parquet(buffer, compression="zstd", compression_level=1, metadata=metadata)
    return buffer.getvalue()
