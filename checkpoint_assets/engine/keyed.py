"""The keyed layout: one Parquet file whose rows are ordered by a shard key column, in row groups
of ``ROW_GROUP_ROWS`` rows with statistics, so that a range shard of any count reads only the row
groups its key range overlaps (plus at most one at each edge).

``write_keyed`` writes it from a stream of batches in bounded memory, whatever the stream's
size, in two passes:

1. Batches are held until they pass ``BUFFER_BYTES``; the stream ends there for small tables,
   which are sorted in memory. Otherwise every ``BUFFER_BYTES`` of rows is spilled to
   ``BUCKETS`` local bucket files by the top bits of the key (a contiguous key range each).
2. Each bucket in key order is read, sorted (and ``resolve``d: one winner per id, for the
   global resume table) and appended to the output: memory holds one bucket, about
   ``1/BUCKETS`` of the table.

A polars sort of the whole stream held about twice the table (4.9 GiB for 8M rows of 500 bytes);
polars' partitioned sink held more than this buffer with 256 open partitions.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

# 16,384 rows a row group: a shard of 1/16 of 8M rows reads at most 2 row groups it does not need
# (one at each end of its key range), 0.4 % more than its own.
ROW_GROUP_ROWS = 1 << 14
BUFFER_BYTES = 128 * 1024**2
BUCKET_BITS = 8
BUCKETS = 1 << BUCKET_BITS
_BUCKET = "_bucket"

Resolve = Callable[[pl.DataFrame], pl.DataFrame]


def write_keyed(
    batches: Iterable[pl.DataFrame],
    key_column: str,
    path: str,
    schema: pl.Schema,
    resolve: Resolve | None = None,
) -> int:
    """Write ``batches`` (each with ``key_column``, an Int64 shard key) to the local file
    ``path`` ordered by it; returns the number of rows written. ``resolve`` is applied to each
    bucket's rows before they are sorted (rows of one key are always in one bucket)."""
    # The top BUCKET_BITS of the key (floor division keeps the order of signed keys).
    top = pl.col(key_column) // (1 << (64 - BUCKET_BITS)) + BUCKETS // 2
    with _Output(path, key_column, schema, resolve) as output, Buckets(top) as buckets:
        for batch in batches:
            buckets.add(batch)
        held = buckets.in_memory()
        if held is not None:
            output.write(held)
        for index in buckets.indexes():
            output.write(buckets.take(index, conformed=True))
        return output.rows


class Buckets:
    """Rows split by ``bucket`` (an Int expression) into local files, written as they pass:
    held in memory until they pass ``BUFFER_BYTES``, so a stream that ends first is never
    spilled (``in_memory``). Batches may differ in columns (checkpoints of a function whose
    outputs changed): a bucket then has a file per set of columns, read back together."""

    def __init__(self, bucket: pl.Expr) -> None:
        self.bucket = bucket.alias(_BUCKET)
        self.folder: str | None = None
        self.writers: dict[int, list[pq.ParquetWriter]] = {}
        self.held: list[pl.DataFrame] = []
        self.size = 0.0
        self.schema = pl.Schema()  # every column spilled, in the order first seen

    def __enter__(self) -> Buckets:
        return self

    def __exit__(self, *exc: object) -> None:
        for writers in self.writers.values():
            for writer in writers:
                writer.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def add(self, rows: pl.DataFrame) -> None:
        self.held.append(rows)
        self.size += rows.estimated_size()
        if self.size > BUFFER_BYTES:
            self.spill()

    def in_memory(self) -> pl.DataFrame | None:
        """Every row added, when none was spilled (None otherwise, after spilling the rest)."""
        if self.folder is not None:
            self.spill()
            return None
        rows = pl.concat(self.held, how="diagonal_relaxed") if self.held else None
        self.held, self.size = [], 0.0
        return rows

    def spill(self) -> None:
        if not self.held:
            return
        rows = pl.concat(self.held, how="diagonal_relaxed").with_columns(self.bucket)
        self.held, self.size = [], 0.0
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix="checkpoint-assets-buckets-")
        parts = rows.partition_by(_BUCKET, as_dict=True, include_key=False)
        added = {c: t for c, t in rows.drop(_BUCKET).schema.items() if c not in self.schema}
        self.schema = pl.Schema({**self.schema, **added})
        for (index,), part in parts.items():
            table = part.to_arrow()
            writers = self.writers.setdefault(index, [])
            writer = next((w for w in writers if w.schema.equals(table.schema)), None)
            if writer is None:
                path = os.path.join(self.folder, f"{index}-{len(writers)}.parquet")
                writer = pq.ParquetWriter(path, table.schema, compression="lz4")
                writers.append(writer)
            writer.write_table(table)

    def indexes(self) -> list[int]:
        """The buckets spilled, in order."""
        return sorted(self.writers)

    def take(self, index: int, *, conformed: bool = False) -> pl.DataFrame | None:
        """The rows of bucket ``index`` (None when it has none); its files are removed.
        ``conformed``: with every column spilled (``schema``), in that order."""
        writers = self.writers.pop(index, [])
        frames = []
        for writer in writers:
            writer.close()
            frames.append(pl.read_parquet(writer.where))
            os.remove(writer.where)
        if conformed:
            frames.insert(0, pl.DataFrame(schema=self.schema))
        return pl.concat(frames, how="diagonal_relaxed") if writers else None


class _Output:
    """The output file, written a sorted bucket at a time."""

    def __init__(
        self, path: str, key_column: str, schema: pl.Schema, resolve: Resolve | None
    ) -> None:
        self.path = path
        self.key_column = key_column
        self.schema = schema
        self.resolve = resolve
        self.writer: pq.ParquetWriter | None = None
        self.rows = 0

    def __enter__(self) -> _Output:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.writer is None:  # no rows: a file of the schema alone
            pl.DataFrame(schema=self.schema).write_parquet(self.path)
        else:
            self.writer.close()

    def write(self, rows: pl.DataFrame | None) -> None:
        if rows is None or rows.height == 0:
            return
        if self.resolve is not None:
            rows = self.resolve(rows)
        table: pa.Table = rows.sort(self.key_column).to_arrow()
        if self.writer is None:
            self.writer = pq.ParquetWriter(
                self.path, table.schema, compression="zstd", write_statistics=True
            )
        self.writer.write_table(table.cast(self.writer.schema), row_group_size=ROW_GROUP_ROWS)
        self.rows += table.num_rows
