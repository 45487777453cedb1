"""Reading stored files: columns with one value in every row come back as constants (no memory per
row), every other column as it was written, and every page of every column is checked."""

from __future__ import annotations

import io

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from checkpoint_assets.engine.checkpoints import parquet

ROWS = 300_000


def stored(rows: int = ROWS) -> pl.DataFrame:
    """A merged file's rows where most rows succeeded on the first attempt."""
    return pl.DataFrame(
        {
            "id": pl.int_range(rows, eager=True),
            "score": pl.int_range(rows, eager=True) % 7,
            "label": pl.Series(["short"] * rows),
            "mixed": pl.Series(["a", "b"] * (rows // 2)),
            "ratio": pl.Series([0.5] * rows),
            "_attempts": pl.Series([1] * rows, dtype=pl.Int32),
            "_error": pl.Series([None] * rows, dtype=pl.String),
            "_input_hash": pl.Series([2**64 - 1] * rows, dtype=pl.UInt64),
            "_current": pl.Series([True] * rows),
        }
    )


def merged_file(frame: pl.DataFrame, row_group_size: int | None = None) -> bytes:
    """Bytes of ``frame`` as a merged file, optionally in smaller row groups."""
    data = parquet.encode(frame, {parquet.WATERMARK_KEY: "3"})
    if row_group_size is None:
        return data
    table = pq.read_table(pa.BufferReader(data))
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=row_group_size, write_page_checksum=True)
    return buffer.getvalue()


def constant(frame: pl.DataFrame, column: str) -> bool:
    """Whether ``column`` of ``frame`` takes no memory per row (a constant)."""
    return frame.select(column).estimated_size() < 1000


def test_columns_with_one_value_read_back_equal_and_as_constants() -> None:
    frame = stored()

    read = parquet.decode(merged_file(frame, row_group_size=ROWS // 3))

    assert read.schema == frame.schema
    assert read.equals(frame)
    for column in ("label", "_attempts", "_error", "_input_hash", "_current"):
        assert constant(read, column), column
    for column in ("id", "score", "mixed", "ratio"):  # floats: their statistics leave NaN out
        assert not constant(read, column), column


def test_a_column_constant_within_each_row_group_but_not_across_them_is_read_as_it_is() -> None:
    rows = ROWS // 3
    ids = pl.int_range(3 * rows, eager=True)
    frame = pl.DataFrame({"id": ids, "_seq": ids // rows})
    partly_null = pl.DataFrame(
        {"id": ids[: 2 * rows], "_error": [None] * rows + ["boom"] * rows},
        schema={"id": pl.Int64, "_error": pl.String},
    )

    read = parquet.decode(merged_file(frame, row_group_size=rows))
    read_nulls = parquet.decode(merged_file(partly_null, row_group_size=rows))

    assert read.equals(frame) and not constant(read, "_seq")
    assert read_nulls.equals(partly_null) and not constant(read_nulls, "_error")


def test_a_file_of_one_row_or_none_or_of_constants_only_reads_back_equal() -> None:
    one = stored().head(1)
    none = stored().clear()
    only = stored().select("label", "_attempts", "_error")

    assert parquet.decode(merged_file(one)).equals(one)
    assert parquet.decode(merged_file(none)).equals(none)
    assert parquet.decode(merged_file(only)).equals(only)


def test_a_part_without_statistics_reads_back_as_it_is() -> None:
    frame = stored(1000)

    read = parquet.decode(parquet.encode(frame, part=True))

    assert read.equals(frame) and not constant(read, "_attempts")


@pytest.mark.parametrize("column", ["label", "_attempts", "_error", "_current"])
def test_a_changed_byte_in_the_pages_of_a_constant_column_makes_the_file_unreadable(
    column: str,
) -> None:
    """Constants come from the statistics, but their pages are read and checked all the same."""
    data = merged_file(stored())
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    index = meta.schema.to_arrow_schema().get_field_index(column)
    chunk = meta.row_group(0).column(index)
    start = min(chunk.data_page_offset, chunk.dictionary_page_offset or chunk.data_page_offset)
    at = start + chunk.total_compressed_size - 2  # inside its last data page
    damaged = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]

    with pytest.raises(OSError, match="CRC"):
        parquet.decode(damaged)


IDS = 50_000


def ids_and_hashes(ids: pl.Series) -> pl.DataFrame:
    """Stored rows of ``ids``: a nested output, random input hashes, no errors."""
    rows = ids.len()
    return pl.DataFrame(
        {
            "id": ids,
            "answer": pl.select(pl.struct(label=pl.lit("a"), tokens=pl.lit([1, 2])))
            .to_series()
            .extend_constant(None, rows - 1),
            "_input_hash": pl.int_range(rows, eager=True).hash(7),
            "_error": pl.Series([None] * rows, dtype=pl.String),
        }
    )


def written(frame: pl.DataFrame, part: bool) -> bytes:
    """``frame`` as the engine writes a part or a merged file (ids and hashes named)."""
    metadata = None if part else {parquet.WATERMARK_KEY: "3"}
    return parquet.encode(frame, metadata, part=part, distinct=["id"], hashes=["_input_hash"])


@pytest.mark.parametrize("part", [True, False], ids=["part", "merged"])
@pytest.mark.parametrize(
    "ids",
    [
        pl.int_range(IDS, eager=True),
        pl.int_range(IDS, eager=True).shuffle(seed=1),
        pl.int_range(IDS, eager=True, dtype=pl.UInt32) * 3,
        pl.int_range(IDS, eager=True).cast(pl.String),
    ],
    ids=["sorted", "shuffled", "uint32", "strings"],
)
def test_ids_and_hashes_read_back_equal_from_parts_and_merged_files(
    ids: pl.Series, part: bool
) -> None:
    frame = ids_and_hashes(ids.alias("id"))

    assert parquet.decode(written(frame, part)).equals(frame)
    assert parquet.decode(written(frame.drop("answer"), part)).equals(frame.drop("answer"))


@pytest.mark.parametrize("part", [True, False], ids=["part", "merged"])
def test_integer_ids_in_input_order_take_a_fraction_of_a_byte_each(part: bool) -> None:
    """Sorted ids written plain take 8 bytes each in a part (lz4 barely shrinks them), about 1
    in a merged file (zstd): storage and encoding time spent on what a delta encodes in bits."""
    data = written(ids_and_hashes(pl.int_range(IDS, eager=True).alias("id")), part)

    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    ids = [meta.row_group(g).column(0) for g in range(meta.num_row_groups)]
    assert ids[0].path_in_schema == "id"
    assert sum(chunk.total_compressed_size for chunk in ids) < IDS / 20


@pytest.mark.parametrize("part", [True, False], ids=["part", "merged"])
def test_a_changed_byte_in_the_uncompressed_pages_of_input_hashes_makes_the_file_unreadable(
    part: bool,
) -> None:
    data = written(ids_and_hashes(pl.int_range(IDS, eager=True).alias("id")).drop("answer"), part)
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    index = meta.schema.to_arrow_schema().get_field_index("_input_hash")
    chunk = meta.row_group(0).column(index)
    assert chunk.compression == "UNCOMPRESSED"
    at = chunk.data_page_offset + chunk.total_compressed_size - 2
    damaged = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]

    with pytest.raises(OSError, match="CRC"):
        parquet.decode(damaged)


def test_a_merged_file_read_a_row_group_at_a_time_holds_one_row_group_and_reads_back_equal() -> (
    None
):
    frame = stored()
    data = merged_file(frame, row_group_size=50_000)

    groups = list(parquet.decode_groups(data))

    assert [g.height for g in groups] == [50_000] * 6  # what a streamed reader holds at once
    assert pl.concat(groups).equals(frame)
    assert pl.concat(groups).equals(parquet.decode(data))


def test_a_changed_byte_fails_the_row_group_read_too() -> None:
    data = bytearray(merged_file(stored(), row_group_size=50_000))
    data[len(data) // 2] ^= 0xFF

    with pytest.raises(OSError):
        list(parquet.decode_groups(bytes(data)))
