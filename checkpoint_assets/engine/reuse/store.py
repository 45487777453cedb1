"""``ResultStore``: results kept by scope and content key (``layout.py``), on any store.

Adding writes one new file per bucket the rows fall in, under a unique name: many shards add at
once with no lock, and nothing is rewritten in place. Rows are sorted by ``ID_KEY``, the shard
key of the id that asked, so a shard asking again with the same ids finds its rows together.

A lookup lists the scope once, then reads only the files of the buckets its keys fall in, each
file's footer once, in two passes:

1. near: the row groups whose ``ID_KEY`` range holds the id key of a wanted row (its ids asked
   before: a new tag, another asset over the same rows);
2. the rest: for the keys still missing, the row groups not read yet whose ``KEY_HI`` range
   holds one (other ids, or a key never stored).

Of each row group it reads the key columns, then the other columns only where a key matched. A
key stored twice (two shards computed it at once) is taken from the oldest file.
"""

from __future__ import annotations

import io
import posixpath
import struct
from collections.abc import Iterable

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from checkpoint_assets.engine.reuse.layout import (
    ID_KEY,
    KEY_HI,
    KEYS,
    ROW_GROUP_ROWS,
    bucket,
    bucket_of,
    new_file,
)
from checkpoint_assets.engine.storage.arrow import ranged_file
from checkpoint_assets.engine.storage.base import FileInfo, Store

_BUCKET = "__bucket"
# A file this small is read whole, in one GET: its footer alone would take as many.
WHOLE_FILE_BYTES = 1 << 16


class ResultStore:
    """The result store in the folder ``root`` of ``store`` (its root by default)."""

    def __init__(self, store: Store, root: str | None = None) -> None:
        self.store = store
        self.root = root or store.root
        self.unreadable: list[str] = []  # files the last lookup could not read (damaged)

    @property
    def url(self) -> str:
        return self.store.display(self.root)

    def files(self, scope: str | None = None) -> list[FileInfo]:
        """Every result file (of ``scope``, when given), oldest first."""
        folder = posixpath.join(self.root, scope) if scope else self.root
        found = [f for f in self.store.list_recursive(folder) if bucket_of(f.path) is not None]
        return sorted(found, key=lambda f: (f.name, f.path))

    def add(self, scope: str, results: pl.DataFrame) -> int:
        """Store ``results`` (``KEY_HI``, ``KEY_LO``, ``ID_KEY`` and output columns) in
        ``scope``: one new file per bucket. Returns the rows written (a key once)."""
        results = results.unique(subset=list(KEYS), keep="first")
        if not results.height:
            return 0
        by_bucket = results.with_columns(bucket().alias(_BUCKET)).partition_by(
            _BUCKET, as_dict=True
        )
        for (index,), rows in by_bucket.items():
            path = new_file(self.root, scope, int(index))  # type: ignore[call-overload]
            self.write(path, rows.drop(_BUCKET))
        return results.height

    def write(self, path: str, rows: pl.DataFrame) -> None:
        """Write ``rows`` as the result file ``path``, sorted by ``ID_KEY`` (else by key)."""
        order = [ID_KEY, *KEYS] if ID_KEY in rows.columns else list(KEYS)
        buffer = io.BytesIO()
        rows.sort(order).write_parquet(
            buffer, compression="zstd", statistics=True, row_group_size=ROW_GROUP_ROWS
        )
        self.store.put(path, buffer.getvalue())

    def lookup(self, scope: str, keys: pl.DataFrame) -> pl.DataFrame:
        """The stored results of ``keys`` (``KEY_HI``, ``KEY_LO``, and ``ID_KEY`` when known)
        in ``scope``: their keys and output columns, one row per key found."""
        near = ID_KEY in keys.columns
        wanted = keys.select(*KEYS, *([ID_KEY] if near else [])).unique(subset=list(KEYS))
        wanted = wanted.with_columns(bucket().alias(_BUCKET)).sort(KEYS)
        by_bucket = wanted.partition_by(_BUCKET, as_dict=True).items()
        left = {b: f.drop(_BUCKET) for (b,), f in by_bucket}
        found: list[pl.DataFrame] = []
        self.unreadable = []
        opened: dict[str, _File | None] = {}
        for _ in range(2):  # a file merged away meanwhile: its merged file is listed again
            files = [f for f in self.files(scope) if f.path not in opened]
            files = [f for f in files if bucket_of(f.path) in left]
            if not files or not self._search(files, left, found, opened, near):
                break
        if not found:
            return pl.DataFrame(schema={k: pl.Int64 for k in KEYS})
        return pl.concat(found, how="diagonal_relaxed")

    def _search(
        self,
        files: list[FileInfo],
        left: dict[int, pl.DataFrame],
        found: list[pl.DataFrame],
        opened: dict[str, _File | None],
        near: bool,
    ) -> bool:
        """Both passes over ``files``; whether one of them vanished."""
        vanished = False
        for first in (True, False) if near else (False,):
            for f in files:
                index = bucket_of(f.path) or 0  # every file listed here has a bucket
                mine = left.get(index)
                if mine is None or not mine.height or opened.get(f.path, True) is None:
                    continue
                try:
                    if f.path not in opened:
                        opened[f.path] = _File.open(self.store, f)
                    reader = opened[f.path]
                    assert reader is not None
                    hits = reader.select(mine, near=first)
                except FileNotFoundError:
                    opened[f.path], vanished = None, True
                    continue
                except (pa.ArrowException, ValueError):  # damaged: its rows are computed again
                    opened[f.path] = None
                    self.unreadable.append(self.store.display(f.path))
                    continue
                if hits.height:
                    found.append(hits)
                    left[index] = mine.join(hits.select(KEYS), on=list(KEYS), how="anti")
        return vanished


class _File:
    """One result file being looked up: its footer, and the row groups whose keys were read."""

    def __init__(self, parquet: pq.ParquetFile) -> None:
        self.parquet = parquet
        self.metadata = parquet.metadata
        self.read: set[int] = set()

    @classmethod
    def open(cls, store: Store, f: FileInfo) -> _File:
        """A small file read whole; a large one's footer read exactly (two ranged GETs)."""
        if f.size <= WHOLE_FILE_BYTES:
            return cls(pq.ParquetFile(io.BytesIO(store.get(f.path))))
        tail = store.get_range(f.path, f.size - 8, f.size)
        (length,) = struct.unpack("<I", tail[:4])
        footer = store.get_range(f.path, f.size - 8 - length, f.size - 8)
        metadata = pq.read_metadata(io.BytesIO(b"PAR1" + footer + tail))
        source = ranged_file(store, f.path, f.size)
        return cls(pq.ParquetFile(source, metadata=metadata, pre_buffer=True))

    def select(self, wanted: pl.DataFrame, *, near: bool) -> pl.DataFrame:
        """The rows whose key is among ``wanted`` (sorted by key), from the row groups not read
        yet whose ``ID_KEY`` (``near``) or ``KEY_HI`` range holds a wanted one."""
        column = ID_KEY if near else KEY_HI
        values = np.sort(wanted.get_column(column).drop_nulls().to_numpy())
        groups = [g for g in _holding(self.metadata, column, values) if g not in self.read]
        if not groups:
            return wanted.clear()
        self.read.update(groups)
        keys = _frame(self.parquet.read_row_groups(groups, columns=list(KEYS)))
        hits = keys.with_row_index("__row").join(wanted.select(KEYS), on=list(KEYS), how="semi")
        if not hits.height:
            return wanted.clear().select(KEYS)
        sizes = [self.metadata.row_group(g).num_rows for g in groups]
        ends = np.cumsum(sizes)
        holding = np.unique(np.searchsorted(ends, hits.get_column("__row").to_numpy(), "right"))
        others = [c for c in self.parquet.schema_arrow.names if c not in KEYS and c != ID_KEY]
        values_read = self.parquet.read_row_groups([groups[i] for i in holding], columns=others)
        held = pl.concat([keys.slice(int(ends[i] - sizes[i]), sizes[i]) for i in holding])
        rows = held.hstack(_frame(values_read).get_columns())
        return rows.join(wanted.select(KEYS), on=list(KEYS), how="semi")


def _frame(table: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    return frame


def _holding(metadata: pq.FileMetaData, column: str, values: np.ndarray) -> Iterable[int]:
    """The row groups whose ``column`` range holds one of ``values`` (sorted)."""
    index = metadata.schema.to_arrow_schema().get_field_index(column)
    if index < 0:
        return
    for group in range(metadata.num_row_groups):
        stats = metadata.row_group(group).column(index).statistics
        if stats is None or not stats.has_min_max:
            yield group
            continue
        at = int(np.searchsorted(values, stats.min, "left"))
        if at < values.size and values[at] <= stats.max:
            yield group
