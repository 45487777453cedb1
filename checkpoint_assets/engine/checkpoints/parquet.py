"""Parquet encoding of stored rows: parts (written on the hot path) and merged files.

Parts live briefly and are written once per flush. Pyarrow writes them with lz4, without
statistics or dictionaries. That takes about half the time polars takes for a small frame: its
fixed cost per file dominates parts of a few rows. Merged files are zstd, with statistics, and
carry the checkpoint's watermark in their own Parquet metadata. In both, integer ids are
delta-encoded and input hashes stored uncompressed (see ``encode``).

Every page of every file carries a CRC32 checksum, checked on every read. A file with a few bytes
damaged in its middle then fails to read instead of decoding into other values. (Zstd and lz4 do
not always notice such damage.) So the file is treated as damaged rather than as done. Files
without checksums (older versions wrote none) still read, unchecked.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from checkpoint_assets.engine.errors import CheckpointError

WATERMARK_KEY = "checkpoint_assets.watermark"
# Files of fewer rows are read as they are: constants would spare little memory for a second read.
CONSTANT_MIN_ROWS = 1 << 16


def encode(
    rows: pl.DataFrame,
    metadata: dict[str, str] | None = None,
    *,
    part: bool = False,
    distinct: Sequence[str] = (),
    hashes: Sequence[str] = (),
) -> bytes:
    """Parquet bytes of ``rows``: a part (``part=True``) or a merged file.

    Strings are stored as Arrow string views (polars' own layout), which read back into polars
    without a copy. Where pyarrow cannot write views (some nested columns), they are plain
    strings.

    - ``distinct``: columns whose values are (nearly) all different, the ids. They are written
      without a dictionary, which pyarrow would build and then drop. Integer ones are
      delta-encoded: ids in input order then take a few bits each. Written plain and
      compressed, they take a quarter of a merged file's encoding time and an eighth of its size.
    - ``hashes``: columns of random bits, the input hashes. They are written plain and
      uncompressed, since no codec shrinks them. Zstd would spend a tenth of a merged file's
      encoding time on them for nothing.
    """
    columns = _Columns(distinct, hashes)
    try:
        table = rows.to_arrow(compat_level=pl.CompatLevel.newest())
        return _encode(table, metadata, part, columns)
    except pa.ArrowNotImplementedError:
        return _encode(rows.to_arrow(), metadata, part, columns)


@dataclass(frozen=True)
class _Columns:
    """Which columns ``encode`` writes its own way."""

    distinct: Sequence[str]
    hashes: Sequence[str]

    def encodings(self, table: pa.Table) -> dict[str, str]:
        """Delta encoding for the distinct integer columns."""
        return {
            name: "DELTA_BINARY_PACKED"
            for name in self.distinct
            if name in table.column_names and pa.types.is_integer(table.schema.field(name).type)
        }

    def codecs(self, table: pa.Table, codec: str) -> str | dict[str, str]:
        """``codec`` for every column but the hashes. Per column only when no column is nested:
        pyarrow names a nested column's leaves by their paths and leaves others uncompressed."""
        if not set(self.hashes) & set(table.column_names) or any(
            pa.types.is_nested(field.type) for field in table.schema
        ):
            return codec
        return {c: "none" if c in self.hashes else codec for c in table.column_names}


def _encode(
    table: pa.Table, metadata: dict[str, str] | None, part: bool, columns: _Columns
) -> bytes:
    buffer = io.BytesIO()
    if part:
        pq.write_table(
            table,
            buffer,
            compression=columns.codecs(table, "lz4"),
            use_dictionary=False,
            column_encoding=columns.encodings(table),
            write_statistics=False,
            write_page_checksum=True,
        )
    else:
        if metadata:
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
        plain = {*columns.distinct, *columns.hashes}
        pq.write_table(
            table,
            buffer,
            compression=columns.codecs(table, "zstd"),  # zstd at its default level, 1
            use_dictionary=[c for c in table.column_names if c not in plain],
            column_encoding=columns.encodings(table),
            write_page_checksum=True,
        )
    return buffer.getvalue()


def decode(raw: bytes) -> pl.DataFrame:
    """A Parquet file as a DataFrame, each column that holds one value in every row as a constant.

    Raises if a page's checksum does not match its bytes: every page of every column is read and
    checked.

    Polars gives every value of a column its own slot (16 bytes for a string, nulls included).
    A constant takes nothing. As values, the ``_error`` column of 10**7 successful rows would
    take 160 MB, ``_attempts`` 40 MB. The file's column statistics tell which columns may be
    constant: their null counts, and minimum equal to maximum for integers, booleans and
    strings. Such a column is kept as a constant only if its values read back all equal to it.
    A file without statistics (parts), or of fewer than ``CONSTANT_MIN_ROWS`` rows, is read as
    it is.
    """
    file, columns, complete = _open(raw)
    return complete(_read(file, columns))


def decode_groups(raw: bytes) -> Iterator[pl.DataFrame]:
    """``decode``, a row group at a time: memory holds one row group's rows, not the file's."""
    file, columns, complete = _open(raw)
    for group in _groups(file, columns):
        yield complete(group)


def _open(
    raw: bytes,
) -> tuple[pq.ParquetFile, list[str], Callable[[pl.DataFrame], pl.DataFrame]]:
    """The file of ``raw`` (its pages checked as read), the columns to read from it, and more.

    The third item completes a frame of those columns: the constant columns (``decode``), in the
    file's order.
    """
    file = pq.ParquetFile(pa.BufferReader(raw), pre_buffer=False, page_checksum_verification=True)
    names = file.schema_arrow.names
    constants = _constants(raw, file)
    schema = _frame(_empty(file)).schema if constants else pl.Schema()
    values = [pl.lit(value, schema[c]).alias(c) for c, value in constants.items()]

    def complete(frame: pl.DataFrame) -> pl.DataFrame:
        return frame.with_columns(values).select(names) if values else frame

    return file, [c for c in names if c not in constants], complete


def watermark(raw: bytes) -> int:
    """The highest flush a merged file holds (0 when it records none)."""
    return int(pl.read_parquet_metadata(raw).get(WATERMARK_KEY, "0"))


def check_storable(sample: pl.DataFrame) -> None:
    """Raise a clear error if parts or the merged file cannot store a column of ``sample``.

    Int128 fails to encode; an Object column would become the bytes of Python pointers in a
    part, and fails in the merged file. Checked on a run's first result, before any flush.
    """
    if pl.Object not in sample.schema.values():
        try:
            encode(sample, part=True)
            encode(sample)
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
            encode(one, part=True)
            encode(one)
        except Exception as e:
            bad[column] = f"{one.schema[column]} ({e})"
    if bad:
        raise CheckpointError(
            "The function returns columns that a Parquet checkpoint cannot store: "
            + "; ".join(f"{c}: {why}" for c, why in bad.items())
            + ".",
            "Cast them in the function (to Int64, Float64 or String, for example).",
        )


def _read(file: pq.ParquetFile, columns: list[str]) -> pl.DataFrame:
    """``columns`` of ``file``, one row group at a time: faster, and less memory at its peak,
    than the whole table at once."""
    if file.num_row_groups == 0:
        return _frame(_empty(file)).select(columns)
    return pl.concat(list(_groups(file, columns)), rechunk=False)


def _empty(file: pq.ParquetFile) -> pa.Table:
    """A table of no rows with ``file``'s schema. Built from no batches: pyarrow's
    ``Schema.empty_table()`` imports pandas, which takes seconds in a process that had not."""
    return pa.Table.from_batches([], schema=file.schema_arrow)


def _groups(file: pq.ParquetFile, columns: list[str]) -> Iterator[pl.DataFrame]:
    for g in range(file.num_row_groups):
        yield _frame(file.read_row_group(g, columns=columns, use_threads=False))


def _constants(raw: bytes, file: pq.ParquetFile) -> dict[str, object]:
    """The columns of ``file`` (``raw``) that hold one value, or only nulls, in every row.

    The candidates come from the statistics. Each is then read, a row group at a time (its pages
    checked). It is kept only if every value equals the candidate's. Strings are read as
    dictionaries: 4 bytes a row instead of a 16-byte view. Read before the other columns, these
    short-lived buffers leave no gaps among the ones that stay.
    """
    if file.metadata.num_rows < CONSTANT_MIN_ROWS:
        return {}
    candidates = _constant_candidates(file.metadata)
    if not candidates:
        return {}
    reader = pq.ParquetFile(
        pa.BufferReader(raw),
        metadata=file.metadata,
        read_dictionary=[c for c in candidates if _is_string(file.schema_arrow.field(c).type)],
        pre_buffer=False,
        page_checksum_verification=True,
    )
    for g in range(reader.num_row_groups):
        group = reader.read_row_group(g, columns=list(candidates), use_threads=False)
        for name in list(candidates):
            if not _all_equal(group.column(name), candidates[name]):
                del candidates[name]
        if not candidates:
            break
    return candidates


def _all_equal(column: pa.ChunkedArray, value: object) -> bool:
    if value is None:
        return bool(column.null_count == len(column))
    if column.null_count:
        return False
    for chunk in column.chunks:
        if isinstance(chunk, pa.DictionaryArray):
            chunk = chunk.dictionary.take(pc.unique(chunk.indices))
        extremes = pc.min_max(chunk)
        if len(chunk) and not extremes["min"].as_py() == extremes["max"].as_py() == value:
            return False
    return True


def _frame(table: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(table, rechunk=False)
    assert isinstance(frame, pl.DataFrame)
    return frame


def _constant_candidates(meta: pq.FileMetaData) -> dict[str, object]:
    """Columns whose statistics say they hold one value, or only nulls, in every row."""
    schema = meta.schema.to_arrow_schema()
    kinds = {f.name: f.type for f in schema if not pa.types.is_nested(f.type)}
    seen: dict[str, set[object]] = {name: set() for name in kinds}
    nulls = dict.fromkeys(kinds, 0)
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for i in range(group.num_columns):
            column = group.column(i)
            name = column.path_in_schema
            if name not in seen:
                continue
            stats = column.statistics
            if stats is None or not stats.has_null_count:
                del seen[name]
                continue
            nulls[name] += stats.null_count
            if stats.null_count == group.num_rows:
                continue
            if _exact(kinds[name]) and stats.has_min_max and stats.min == stats.max:
                seen[name].add(stats.min)
            else:
                del seen[name]
    found: dict[str, object] = {}
    for name, values in seen.items():
        if meta.num_rows and nulls[name] == meta.num_rows:
            found[name] = None
        elif nulls[name] == 0 and len(values) == 1:
            found[name] = values.pop()
    if found and len(found) == len(schema):  # read one column, for the number of rows
        found.pop(schema.names[0])
    return found


def _exact(kind: pa.DataType) -> bool:
    """Types whose statistics are their exact values (floats leave NaN out)."""
    return bool(pa.types.is_integer(kind) or pa.types.is_boolean(kind)) or _is_string(kind)


def _is_string(kind: pa.DataType) -> bool:
    plain = pa.types.is_string(kind) or pa.types.is_large_string(kind)
    return bool(plain) or kind == pa.string_view()
