"""The keyed layout written from a stream: ordered by the key, every row kept, in bounded memory
(rows past the buffer go through bucket files), the same file whether or not it spilled."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from checkpoint_assets.engine.sharding import hashing, keyed
from checkpoint_assets.engine.sharding.keyed import ROW_GROUP_ROWS, Buckets, write_keyed

KEY = "_shard_key:id"


def batches(rows: int, size: int, *, start: int = 0) -> list[pl.DataFrame]:
    frame = pl.DataFrame({"id": range(start, start + rows), "text": [f"t{i}" for i in range(rows)]})
    frame = frame.with_columns(hashing.shard_key("id", pl.Int64).alias(KEY))
    return [frame.slice(s, size) for s in range(0, rows, size)]


def newest(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per id: the last one added (a ``resolve`` as the global resume table's)."""
    return rows.filter(pl.col("id").is_last_distinct())


@pytest.mark.parametrize("buffer_bytes", [1 << 40, 64 * 1024])  # in memory; spilled
def test_a_stream_is_written_ordered_by_its_key_in_row_groups_that_never_straddle_buckets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, buffer_bytes: int
) -> None:
    monkeypatch.setattr(keyed, "BUFFER_BYTES", buffer_bytes)
    parts = batches(50_000, 3_000)
    path = str(tmp_path / "out.parquet")

    rows = write_keyed(iter(parts), KEY, path, parts[0].schema)

    stored = pl.read_parquet(path)
    assert rows == stored.height == 50_000
    assert stored[KEY].is_sorted()
    assert stored.sort("id").equals(pl.concat(parts).sort("id"))
    meta = pq.read_metadata(path)
    assert all(meta.row_group(g).num_rows <= ROW_GROUP_ROWS for g in range(meta.num_row_groups))


def test_the_spilled_stream_keeps_the_resolved_winner_of_every_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keyed, "BUFFER_BYTES", 32 * 1024)
    older = [b.with_columns(text=pl.lit("old")) for b in batches(20_000, 2_000)]
    newer = [b.with_columns(text=pl.lit("new")) for b in batches(5_000, 2_000, start=10_000)]
    path = str(tmp_path / "out.parquet")

    rows = write_keyed(iter(older + newer), KEY, path, older[0].schema, newest)

    stored = pl.read_parquet(path)
    assert rows == stored.height == 20_000 and stored["id"].n_unique() == 20_000
    texts = dict(zip(stored["id"].to_list(), stored["text"].to_list(), strict=True))
    assert {texts[i] for i in range(10_000, 15_000)} == {"new"}
    assert {texts[i] for i in range(10_000)} == {"old"}


def test_an_empty_stream_writes_a_file_of_the_schema(tmp_path: Path) -> None:
    schema = pl.Schema({"id": pl.Int64, KEY: pl.Int64})

    rows = write_keyed(iter([]), KEY, str(tmp_path / "out.parquet"), schema)

    assert rows == 0
    assert pl.read_parquet(tmp_path / "out.parquet").schema == schema


def test_buckets_remove_their_files_when_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keyed, "BUFFER_BYTES", 1024)
    with Buckets(pl.col("id") % 3) as buckets:
        for batch in batches(3_000, 500):
            buckets.add(batch)
        assert buckets.in_memory() is None
        folder = buckets.folder
        assert folder is not None and len(list(Path(folder).iterdir())) == 3  # one per bucket
        taken = buckets.take(1)
        assert taken is not None and set((taken["id"] % 3).to_list()) == {1}
    assert not Path(folder).exists()


def test_spilled_batches_of_other_columns_are_written_with_every_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keyed, "BUFFER_BYTES", 16 * 1024)
    before = batches(6_000, 2_000)  # a function's outputs before and after it changed
    after = [b.with_columns(score=pl.col("id") * 2) for b in batches(6_000, 2_000, start=6_000)]
    path = str(tmp_path / "out.parquet")

    rows = write_keyed(iter(before + after), KEY, path, before[0].schema)

    stored = pl.read_parquet(path).sort("id")
    assert rows == 12_000 and stored.columns == ["id", "text", KEY, "score"]
    assert stored["score"].null_count() == 6_000
    assert stored.filter(pl.col("id") >= 6_000)["score"].to_list() == list(range(12_000, 24_000, 2))


@pytest.mark.parametrize("rows", [10_000, 40_000])
def test_rows_sorted_at_once_stay_within_the_buffer_however_large_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    # 4 buckets and a buffer of 16 KiB against tables of about 0.3 and 1 MB: every bucket
    # passes the buffer, and is split again by the following bits of the key (more times for
    # the larger table).
    monkeypatch.setattr(keyed, "BUCKET_BITS", 2)
    monkeypatch.setattr(keyed, "BUCKETS", 4)
    monkeypatch.setattr(keyed, "BUFFER_BYTES", 16 * 1024)
    parts = batches(rows, 500)
    row_bytes = parts[0].estimated_size() / parts[0].height
    held: list[int] = []

    def resolve(bucket: pl.DataFrame) -> pl.DataFrame:
        held.append(bucket.height)  # what the writer sorts at once
        return bucket

    path = str(tmp_path / "out.parquet")
    written = write_keyed(iter(parts), KEY, path, parts[0].schema, resolve)

    stored = pl.read_parquet(path)
    assert written == stored.height == rows and stored[KEY].is_sorted()
    assert stored.sort("id").equals(pl.concat(parts).sort("id"))
    assert max(held) * row_bytes < 2 * keyed.BUFFER_BYTES


def test_bucket_files_hold_about_the_bytes_of_their_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keyed, "BUFFER_BYTES", 64 * 1024)
    parts = [b.with_columns(pl.col("text").str.pad_end(200, "x")) for b in batches(20_000, 5_000)]
    with Buckets(pl.col(KEY) // (1 << 56) + 128) as buckets:
        for batch in parts:
            buckets.add(batch)
        assert buckets.in_memory() is None and buckets.folder is not None
        spilled = sum(f.stat().st_size for f in Path(buckets.folder).iterdir())

    assert spilled < 1.5 * sum(b.estimated_size() for b in parts)
