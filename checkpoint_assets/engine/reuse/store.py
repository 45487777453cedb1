"""``ResultStore``: results kept by scope and content key (``layout.py``), on any store.

Adding writes one new file per bucket the rows fall in, under a unique name: many shards add at
once with no lock, and nothing is rewritten in place. A lookup lists the scope once, then reads
only the files of the buckets its keys fall in. In each file it reads the key columns of the row
groups whose key range (their statistics) holds a wanted key, then the other columns of the row
groups holding a match. A key stored twice (two shards computed it at once) is taken from the
oldest file.
"""

from __future__ import annotations

import io
import posixpath
from collections.abc import Iterable

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from checkpoint_assets.engine.reuse.layout import (
    KEY_HI,
    KEYS,
    ROW_GROUP_ROWS,
    bucket,
    bucket_of,
    new_file,
)
from checkpoint_assets.engine.storage.arrow import arrow_filesystem
from checkpoint_assets.engine.storage.base import FileInfo, Store

_BUCKET = "__bucket"
# A file this small is read whole, in one GET.
WHOLE_FILE_BYTES = 1 << 20


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
        """Store ``results`` (``KEY_HI``, ``KEY_LO`` and output columns) in ``scope``: one new
        file per bucket. Returns the rows written (a key once)."""
        results = results.unique(subset=list(KEYS), keep="first")
        if not results.height:
            return 0
        for (index,), rows in (
            results.with_columns(bucket().alias(_BUCKET))
            .partition_by(_BUCKET, as_dict=True)
            .items()
        ):
            self.write(new_file(self.root, scope, int(index)), rows.drop(_BUCKET))  # type: ignore[call-overload]
        return results.height

    def write(self, path: str, rows: pl.DataFrame) -> None:
        """Write ``rows`` as the result file ``path``, sorted by key."""
        buffer = io.BytesIO()
        rows.sort(KEYS).write_parquet(
            buffer, compression="zstd", statistics=True, row_group_size=ROW_GROUP_ROWS
        )
        self.store.put(path, buffer.getvalue())

    def lookup(self, scope: str, keys: pl.DataFrame) -> pl.DataFrame:
        """The stored results of ``keys`` (``KEY_HI``, ``KEY_LO``) in ``scope``: their keys and
        output columns, one row per key found."""
        wanted = keys.select(KEYS).unique().with_columns(bucket().alias(_BUCKET)).sort(KEYS)
        by_bucket = wanted.partition_by(_BUCKET, as_dict=True).items()
        left = {b: f.drop(_BUCKET) for (b,), f in by_bucket}
        found: list[pl.DataFrame] = []
        seen: set[str] = set()
        self.unreadable = []
        for _ in range(2):  # a file merged away meanwhile: its merged file is listed again
            vanished = False
            for f in self.files(scope) if left else []:
                index = bucket_of(f.path)
                mine = left.get(index)
                if f.path in seen or mine is None or not mine.height:
                    continue
                seen.add(f.path)
                try:
                    hits = self._read(f.path, f.size, mine)
                except FileNotFoundError:
                    vanished = True
                    continue
                except (pa.ArrowException, ValueError):  # damaged: its rows are computed again
                    self.unreadable.append(self.store.display(f.path))
                    continue
                if hits.height:
                    found.append(hits)
                    left[index] = mine.join(hits.select(KEYS), on=list(KEYS), how="anti")
            if not vanished:
                break
        if not found:
            return pl.DataFrame(schema={k: pl.Int64 for k in KEYS})
        return pl.concat(found, how="diagonal_relaxed")

    def _read(self, path: str, size: int, wanted: pl.DataFrame) -> pl.DataFrame:
        """The rows of the file ``path`` whose key is among ``wanted`` (sorted by key)."""
        if size <= WHOLE_FILE_BYTES:  # one GET, rather than its footer and then its columns
            return self._select(pq.ParquetFile(io.BytesIO(self.store.get(path))), wanted)
        with arrow_filesystem(self.store).open_input_file(path) as raw:
            return self._select(pq.ParquetFile(raw, pre_buffer=True), wanted)

    def _select(self, parquet: pq.ParquetFile, wanted: pl.DataFrame) -> pl.DataFrame:
        """The rows of ``parquet`` whose key is among ``wanted``: the key columns of the row
        groups whose range holds a wanted key, then the other columns of those holding one."""
        groups = list(_holding(parquet.metadata, wanted.get_column(KEY_HI).to_numpy()))
        if not groups:
            return wanted.clear()
        keys = _frame(parquet.read_row_groups(groups, columns=list(KEYS)))
        hits = keys.with_row_index("__row").join(wanted, on=list(KEYS), how="semi")
        if not hits.height:
            return wanted.clear()
        sizes = [parquet.metadata.row_group(g).num_rows for g in groups]
        ends = np.cumsum(sizes)
        holding = np.unique(np.searchsorted(ends, hits.get_column("__row").to_numpy(), "right"))
        others = [c for c in parquet.schema_arrow.names if c not in KEYS]
        values = _frame(parquet.read_row_groups([groups[i] for i in holding], columns=others))
        held = pl.concat([keys.slice(int(ends[i] - sizes[i]), sizes[i]) for i in holding])
        return held.hstack(values.get_columns()).join(wanted, on=list(KEYS), how="semi")


def _frame(table: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    return frame


def _holding(metadata: pq.FileMetaData, his: np.ndarray) -> Iterable[int]:
    """The row groups whose ``KEY_HI`` range holds one of ``his`` (sorted)."""
    column = metadata.schema.to_arrow_schema().get_field_index(KEY_HI)
    for group in range(metadata.num_row_groups):
        stats = metadata.row_group(group).column(column).statistics
        if stats is None or not stats.has_min_max:
            yield group
            continue
        at = int(np.searchsorted(his, stats.min, "left"))
        if at < his.size and his[at] <= stats.max:
            yield group
