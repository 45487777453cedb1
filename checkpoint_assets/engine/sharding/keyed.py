"""The keyed layout: one Parquet file whose rows are ordered by a shard key column.

The file has row groups of ``ROW_GROUP_ROWS`` rows, with statistics. So a range shard of any
count reads only the row groups its key range overlaps, plus at most one at each edge.

``write_keyed`` writes it from a stream of batches in memory bounded by a constant, whatever the
stream's size:

1. Batches are held until they pass ``BUFFER_BYTES``; the stream ends there for small tables,
   which are sorted in memory. Otherwise every ``BUFFER_BYTES`` of rows is spilled, ``SPILL_ROWS``
   rows at a time, to ``BUCKETS`` local bucket files by the next ``BUCKET_BITS`` of the key (a
   contiguous key range each). Bucket files are Arrow IPC streams: their writers hold nothing
   of what they wrote (a Parquet writer keeps every row group's metadata until it closes).
2. Each bucket in key order is read, sorted (and ``resolve``d: one winner per id, for the
   global resume table) and appended to the output. A bucket larger than ``BUFFER_BYTES`` is
   split again the same way, by the following bits of the key. So memory holds at most about
   ``BUFFER_BYTES`` of rows, however large the table.

Polars alone does not bound memory here. A polars sort of the whole stream holds about twice the
table (4.9 GiB for 8M rows of 500 bytes). Polars' partitioned sink holds more than this buffer
with 256 open partitions.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

# 16,384 rows a row group: a shard of 1/16 of 8M rows reads at most 2 row groups it does not need
# (one at each end of its key range), 0.4 % more than its own.
ROW_GROUP_ROWS = 1 << 14
BUFFER_BYTES = 128 * 1024**2
# Rows split into buckets at once: a spill copies these, not the whole buffer (whose constant
# columns, one value each while held, take their full size once split).
SPILL_ROWS = 1 << 18
BUCKET_BITS = 8
BUCKETS = 1 << BUCKET_BITS
_BUCKET = "_bucket"
_IPC = pa.ipc.IpcWriteOptions(compression="lz4")

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
    with _Output(path, key_column, schema, resolve) as output:
        _write_ordered(batches, key_column, output, pl.Schema(), 0)
        return output.rows


def _write_ordered(
    batches: Iterable[pl.DataFrame], key: str, output: _Output, schema: pl.Schema, level: int
) -> None:
    """Append ``batches`` to ``output`` in key order, bucketed by the ``level``-th bits of the
    key (their order within a bucket of the level above); ``schema``: the columns every
    bucket is written with, in order."""
    with Buckets(_bucket_of(key, level), schema) as buckets:
        for batch in batches:
            buckets.add(batch)
        held = buckets.in_memory(conformed=True)
        if held is not None:
            output.write(held)
        for index in buckets.indexes():
            if buckets.sizes[index] > BUFFER_BYTES and BUCKET_BITS * (level + 2) <= 64:
                _write_ordered(buckets.stream(index), key, output, buckets.schema, level + 1)
            else:
                output.write(buckets.take(index, conformed=True))


def _bucket_of(key: str, level: int) -> pl.Expr:
    """The ``level``-th ``BUCKET_BITS`` of the key from the top, as 0..BUCKETS-1 in key order
    (floor division keeps the order of signed keys)."""
    shifted = pl.col(key) // (1 << (64 - BUCKET_BITS * (level + 1)))
    return shifted + BUCKETS // 2 if level == 0 else shifted & (BUCKETS - 1)


@dataclass
class _File:
    """One local bucket file (an Arrow IPC stream) and its writer, open until read."""

    path: str
    schema: pa.Schema
    writer: pa.ipc.RecordBatchStreamWriter
    open: bool = True

    def close(self) -> None:
        if self.open:
            self.writer.close()
            self.open = False

    def batches(self) -> Iterator[pl.DataFrame]:
        """Its rows, a batch as written at a time."""
        self.close()
        with pa.ipc.open_stream(self.path) as reader:
            for batch in reader:
                frame = pl.from_arrow(batch)
                assert isinstance(frame, pl.DataFrame)
                yield frame


class Buckets:
    """Rows split by ``bucket`` (an Int expression) into local files, written as they pass.

    Rows are held in memory until they pass ``BUFFER_BYTES``. So a stream that ends first is
    never spilled (``in_memory``). Batches may differ in columns (checkpoints of a function whose
    outputs changed). A bucket then has a file per set of columns, read back together.
    ``schema``: columns every bucket is read back with (``conformed``) before those spilled."""

    def __init__(self, bucket: pl.Expr, schema: pl.Schema | None = None) -> None:
        self.bucket = bucket.alias(_BUCKET)
        self.folder: str | None = None
        self.files: dict[int, list[_File]] = {}
        self.sizes: dict[int, int] = {}  # bytes spilled to each bucket, as Arrow holds them
        self.held: list[pl.DataFrame] = []
        self.size = 0.0
        self.schema = pl.Schema(schema or {})  # every column added, in the order first seen

    def __enter__(self) -> Buckets:
        return self

    def __exit__(self, *exc: object) -> None:
        for files in self.files.values():
            for file in files:
                file.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def add(self, rows: pl.DataFrame) -> None:
        self.held.append(rows)
        self.size += rows.estimated_size()
        added = {c: t for c, t in rows.schema.items() if c not in self.schema}
        if added:
            self.schema = pl.Schema({**self.schema, **added})
        if self.size > BUFFER_BYTES:
            self.spill()

    def in_memory(self, *, conformed: bool = False) -> pl.DataFrame | None:
        """Every row added, when none was spilled (None otherwise, after spilling the rest).
        ``conformed``: with every column of ``schema``, in that order."""
        if self.folder is not None:
            self.spill()
            return None
        held, self.held, self.size = self.held, [], 0.0
        return self._concat(held, conformed) if held else None

    def spill(self) -> None:
        if not self.held:
            return
        rows = pl.concat(self.held, how="diagonal_relaxed")
        self.held, self.size = [], 0.0
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix="checkpoint-assets-buckets-")
        for start in range(0, rows.height, SPILL_ROWS):
            part = rows.slice(start, SPILL_ROWS).with_columns(self.bucket)
            for (index,), bucket in part.partition_by(_BUCKET, as_dict=True).items():
                self._write(index, bucket.drop(_BUCKET))

    def _write(self, index: int, rows: pl.DataFrame) -> None:
        # Plain strings, not views: a bucket's views point into the buffers of every row split
        # with it, which an IPC writer would write whole into each bucket's file.
        table = rows.to_arrow()
        files = self.files.setdefault(index, [])
        file = next((f for f in files if f.schema.equals(table.schema)), None)
        if file is None:
            assert self.folder is not None
            path = os.path.join(self.folder, f"{index}-{len(files)}.arrows")
            file = _File(path, table.schema, pa.ipc.new_stream(path, table.schema, options=_IPC))
            files.append(file)
        file.writer.write_table(table, max_chunksize=ROW_GROUP_ROWS)  # read back as written
        self.sizes[index] = self.sizes.get(index, 0) + table.nbytes

    def indexes(self) -> list[int]:
        """The buckets spilled, in order."""
        return sorted(self.files)

    def take(self, index: int, *, conformed: bool = False) -> pl.DataFrame | None:
        """The rows of bucket ``index`` (None when it has none); its files are removed.
        ``conformed``: with every column of ``schema``, in that order."""
        frames = list(self.stream(index))
        return self._concat(frames, conformed) if frames else None

    def stream(self, index: int) -> Iterator[pl.DataFrame]:
        """The rows of bucket ``index``, a batch as written at a time; its files are removed
        as they are read."""
        for file in self.files.pop(index, []):
            yield from file.batches()
            os.remove(file.path)

    def read(self, index: int) -> Iterator[pl.DataFrame]:
        """The rows of bucket ``index``, a batch of at most ``ROW_GROUP_ROWS`` rows at a time,
        as often as asked; its files stay (no row is added once reading starts)."""
        for file in self.files.get(index, []):
            yield from file.batches()

    def _concat(self, frames: list[pl.DataFrame], conformed: bool) -> pl.DataFrame:
        if conformed:
            frames = [pl.DataFrame(schema=self.schema), *frames]
        return pl.concat(frames, how="diagonal_relaxed")


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
