"""Parquet encoding of stored rows: parts (written on the hot path) and merged files.

Parts live briefly and are written once per flush: pyarrow writes them with lz4 and without
statistics or dictionaries, in about half the time polars takes for a small frame (its fixed cost
per file dominates parts of a few rows). Merged files are zstd, with statistics, and carry the
checkpoint's watermark in their own Parquet metadata.

Every page of every file carries a CRC32 checksum, checked on every read: a file with a few bytes
damaged in its middle then fails to read instead of decoding into other values (zstd and lz4 do not
always notice), so it is treated as damaged rather than as done. Files written without checksums
(by older versions) still read, unchecked.
"""

from __future__ import annotations

import io

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from checkpoint_assets.engine.errors import CheckpointError

WATERMARK_KEY = "checkpoint_assets.watermark"


def encode(
    rows: pl.DataFrame, metadata: dict[str, str] | None = None, *, part: bool = False
) -> bytes:
    """Parquet bytes of ``rows``: a part (``part=True``) or a merged file.

    Strings are stored as Arrow string views (polars' own layout), which read back into polars
    without a copy; where pyarrow cannot write views (some nested columns), as plain strings.
    """
    try:
        return _encode(rows.to_arrow(compat_level=pl.CompatLevel.newest()), metadata, part)
    except pa.ArrowNotImplementedError:
        return _encode(rows.to_arrow(), metadata, part)


def _encode(table: pa.Table, metadata: dict[str, str] | None, part: bool) -> bytes:
    buffer = io.BytesIO()
    if part:
        pq.write_table(
            table,
            buffer,
            compression="lz4",
            use_dictionary=False,
            write_statistics=False,
            write_page_checksum=True,
        )
    else:
        if metadata:
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
        pq.write_table(
            table, buffer, compression="zstd", compression_level=1, write_page_checksum=True
        )
    return buffer.getvalue()


def decode(raw: bytes) -> pl.DataFrame:
    """A Parquet file as a DataFrame, each column that is null in every row as a constant.

    Raises if a page's checksum does not match its bytes. Polars gives every string value a
    16-byte view, nulls included: the ``_error`` column of 10**7 successful rows would take 160 MB,
    a constant takes nothing. The null counts come from the file's column statistics; a file
    without them is read as it is.
    """
    file = pq.ParquetFile(pa.BufferReader(raw), pre_buffer=False, page_checksum_verification=True)
    names = file.schema_arrow.names
    empty = _all_null_columns(file.metadata)
    frame = _read(file, [c for c in names if c not in empty])
    if not empty:
        return frame
    schema = _frame(file.schema_arrow.empty_table()).schema
    nulls = [pl.lit(None, schema[c]).alias(c) for c in empty]
    return frame.with_columns(nulls).select(names)


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
        return _frame(file.schema_arrow.empty_table()).select(columns)
    groups = (
        file.read_row_group(g, columns=columns, use_threads=False)
        for g in range(file.num_row_groups)
    )
    return pl.concat([_frame(group) for group in groups], rechunk=False)


def _frame(table: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(table, rechunk=False)
    assert isinstance(frame, pl.DataFrame)
    return frame


def _all_null_columns(meta: pq.FileMetaData) -> set[str]:
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
