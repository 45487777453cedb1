"""The result store on real files: what a lookup reads, shards writing at once, cleaning."""

from __future__ import annotations

import io
import struct
import threading
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from helpers.rows import Storage, engine_settings

from checkpoint_assets.engine import Checkpoint, open_store, prepare, run
from checkpoint_assets.engine.loop.shard_run import RunContext
from checkpoint_assets.engine.reuse import key_filter, layout, upkeep
from checkpoint_assets.engine.reuse.store import WHOLE_FILE_BYTES, ResultStore
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.scheme import Scheme

ID = "ticket_id"
FUNCTION = {"code": "0" * 32}
JOB = {"format": 1, "input_columns": ["body"]}
SCOPE = layout.scope(FUNCTION, JOB)


def results_of(bodies: list[str]) -> pl.DataFrame:
    """Stored results of ``bodies``: their keys and a ``route``."""
    frame = pl.DataFrame({"body": bodies})
    hi, lo = hashing.content_keys(frame, ["body"])
    keys = pl.DataFrame({"hi": hi, "lo": lo}, schema={"hi": pl.UInt64, "lo": pl.UInt64})
    return keys.select(layout.stored_keys("hi", "lo")).with_columns(
        route=pl.Series(bodies).str.to_uppercase()
    )


def test_a_lookup_reads_only_the_buckets_of_its_keys(tmp_path: Any) -> None:
    store = ResultStore(open_store(str(tmp_path / "results")))
    stored = results_of([f"body {i}" for i in range(20_000)])
    store.add(SCOPE, stored)
    one_bucket = stored.filter(layout.bucket() == 7)
    sizes = {f.path: f.size for f in store.files(SCOPE)}
    bucket_bytes = sum(s for p, s in sizes.items() if layout.bucket_of(p) == 7)

    before = store.store.usage()
    found = store.lookup(SCOPE, one_bucket.select(layout.KEYS))
    read = store.store.usage().since(before).bytes_read

    assert found.sort(layout.KEYS).equals(one_bucket.sort(layout.KEYS))
    assert 0 < read <= bucket_bytes
    assert bucket_bytes < sum(sizes.values()) / 100


def test_a_lookup_skips_row_groups_without_its_keys(tmp_path: Any) -> None:
    store = ResultStore(open_store(str(tmp_path / "results")))
    n = 100_000
    stored = results_of([f"body {i}" for i in range(n)]).with_columns(
        route=pl.Series([f"{v:032x}" for v in np.random.default_rng(0).integers(0, 2**62, n)])
    )
    path = layout.new_file(store.root, SCOPE, 0)
    store.write(path, stored)  # one large file, in bucket 0's folder
    size = store.store.size(path)
    assert size > 2 * WHOLE_FILE_BYTES and n > 8 * layout.ROW_GROUP_ROWS
    wanted = stored.filter(layout.bucket() == 0).sort(layout.KEYS).head(10)

    before = store.store.usage()
    found = store.lookup(SCOPE, wanted.select(layout.KEYS))

    assert found.sort(layout.KEYS).equals(wanted)
    assert store.store.usage().since(before).bytes_read < size / 4


def test_a_lookup_by_the_same_ids_reads_only_the_row_groups_of_their_range(tmp_path: Any) -> None:
    store = ResultStore(open_store(str(tmp_path / "results")))
    n = 100_000
    stored = results_of([f"body {i}" for i in range(n)]).with_columns(
        pl.int_range(0, n, dtype=pl.Int64).alias(layout.ID_KEY)  # asked by ids in this order
    )
    path = layout.new_file(store.root, SCOPE, 0)
    store.write(path, stored)  # one large file, in bucket 0's folder
    size = store.store.size(path)
    wanted = stored.filter(layout.bucket() == 0, pl.col(layout.ID_KEY) < n // 16)
    assert wanted.height > 10

    before = store.store.usage()
    found = store.lookup(SCOPE, wanted.select(*layout.KEYS, layout.ID_KEY))

    expect = wanted.drop(layout.ID_KEY).sort(layout.KEYS)
    assert found.sort(layout.KEYS).select(expect.columns).equals(expect)
    assert store.store.usage().since(before).bytes_read < size / 8


def keys_in_bucket(n: int, index: int, seed: int) -> pl.DataFrame:
    """``n`` random stored keys of bucket ``index``, with a ``route`` each."""
    rng = np.random.default_rng(seed)
    top = np.uint64(index) << np.uint64(64 - layout.BUCKET_BITS)
    unsigned = top | rng.integers(0, 1 << (64 - layout.BUCKET_BITS), n, dtype=np.uint64)
    hi = (unsigned ^ np.uint64(1 << 63)).view(np.int64)
    lo = rng.integers(-(1 << 63), (1 << 63) - 1, n, dtype=np.int64)
    return pl.DataFrame({layout.KEY_HI: hi, layout.KEY_LO: lo}).with_columns(
        route=pl.format("ROUTE {}", pl.int_range(0, n))
    )


def _outside_row_groups(results: ResultStore, path: str) -> int:
    """The bytes of result file ``path`` after its last column chunk: its key filter's
    sections, its footer and the footer's length (and a page index, where one is written)."""
    data = results.store.get(path)
    meta = pq.read_metadata(io.BytesIO(data))
    chunks = [
        meta.row_group(g).column(c)
        for g in range(meta.num_row_groups)
        for c in range(meta.num_columns)
    ]
    ends = [
        int(c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset)
        + int(c.total_compressed_size)
        for c in chunks
    ]
    return len(data) - max(ends) - 4  # less the closing "PAR1"


def test_a_lookup_of_keys_never_stored_reads_no_key_column(storage: Storage) -> None:
    base_dir, options = storage
    results = ResultStore(open_store(base_dir, options))
    stored = keys_in_bucket(20_000, 0, seed=1)
    path = layout.new_file(results.root, SCOPE, 0)
    results.write(path, stored)
    assert results.store.size(path) > 2 * WHOLE_FILE_BYTES  # read by ranges, not whole
    absent = keys_in_bucket(5_000, 0, seed=2)
    around = _outside_row_groups(results, path)

    before = results.store.usage()
    found = results.lookup(SCOPE, absent.select(layout.KEYS))
    read = results.store.usage().since(before)

    assert found.height == 0
    assert read.bytes_read <= around  # no byte of a column chunk
    assert read.requests["GET"] == 3


def test_keys_never_stored_asked_with_their_ids_read_no_key_column(tmp_path: Any) -> None:
    results = ResultStore(open_store(str(tmp_path / "results")))
    n = 20_000
    stored = keys_in_bucket(n, 0, seed=1).with_columns(
        pl.int_range(0, n, dtype=pl.Int64).alias(layout.ID_KEY)
    )
    path = layout.new_file(results.root, SCOPE, 0)
    results.write(path, stored)
    absent = keys_in_bucket(500, 0, seed=2).with_columns(
        pl.int_range(0, 500, dtype=pl.Int64).alias(layout.ID_KEY)  # the first row group's ids
    )
    around = _outside_row_groups(results, path)

    before = results.store.usage()
    found = results.lookup(SCOPE, absent.select(*layout.KEYS, layout.ID_KEY))
    read = results.store.usage().since(before).bytes_read

    assert found.height == 0
    assert read <= around  # each section read once, no byte of a column chunk


def test_a_false_positive_of_the_filter_still_finds_nothing(storage: Storage) -> None:
    base_dir, options = storage
    results = ResultStore(open_store(base_dir, options))
    stored = keys_in_bucket(20_000, 0, seed=1)
    path = layout.new_file(results.root, SCOPE, 0)
    results.write(path, stored)
    # Another key with the same fingerprint: its lowest bit is no part of it.
    twins = stored.head(3).with_columns(pl.col(layout.KEY_HI) ^ 1)
    fingerprints = key_filter.fingerprints
    assert np.array_equal(
        fingerprints(twins.get_column(layout.KEY_HI).to_numpy()),
        fingerprints(stored.head(3).get_column(layout.KEY_HI).to_numpy()),
    )
    around = _outside_row_groups(results, path)

    before = results.store.usage()
    found = results.lookup(SCOPE, twins.select(layout.KEYS))
    read = results.store.usage().since(before).bytes_read

    assert found.height == 0
    assert read > around  # the filter said maybe: the key columns said no
    again = results.lookup(SCOPE, pl.concat([twins, stored.head(3)]).select(layout.KEYS))
    assert again.sort(layout.KEYS).equals(stored.head(3).sort(layout.KEYS))


def test_a_file_without_a_filter_is_still_read(tmp_path: Any) -> None:
    results = ResultStore(open_store(str(tmp_path / "results")))
    stored = keys_in_bucket(20_000, 0, seed=1)
    path = layout.new_file(results.root, SCOPE, 0)
    buffer = io.BytesIO()  # as a store written without filters holds them
    stored.write_parquet(buffer, statistics=True, row_group_size=layout.ROW_GROUP_ROWS)
    results.store.put(path, buffer.getvalue())
    absent = keys_in_bucket(100, 0, seed=2)

    asked = pl.concat([stored.slice(7_000, 50), absent])
    found = results.lookup(SCOPE, asked.select(layout.KEYS))

    assert found.sort(layout.KEYS).equals(stored.slice(7_000, 50).sort(layout.KEYS))


def test_a_damaged_filter_still_finds_every_result(tmp_path: Any) -> None:
    results = ResultStore(open_store(str(tmp_path / "results")))
    stored = keys_in_bucket(20_000, 0, seed=1)
    path = layout.new_file(results.root, SCOPE, 0)
    results.write(path, stored)
    data = bytearray(results.store.get(path))
    meta = pq.read_metadata(io.BytesIO(bytes(data)))
    (footer,) = struct.unpack("<I", data[-8:-4])
    spans = key_filter.spans(meta, len(data), footer)
    assert spans is not None
    for start, end in spans:  # every section's bytes flipped, the lengths intact
        data[start:end] = bytes(b ^ 0xFF for b in data[start:end])
    results.store.put(path, bytes(data))
    absent = keys_in_bucket(100, 0, seed=2)

    found = results.lookup(SCOPE, pl.concat([stored.slice(9_000, 40), absent]).select(layout.KEYS))

    assert found.sort(layout.KEYS).equals(stored.slice(9_000, 40).sort(layout.KEYS))
    assert results.unreadable == []


def test_a_key_of_another_scope_is_not_found(tmp_path: Any) -> None:
    store = ResultStore(open_store(str(tmp_path / "results")))
    stored = results_of(["a", "b"])
    store.add(SCOPE, stored)

    other = layout.scope({"code": "1" * 32}, JOB)

    assert store.lookup(other, stored.select(layout.KEYS)).height == 0
    assert store.lookup(SCOPE, stored.select(layout.KEYS)).height == 2


def test_the_scope_leaves_out_where_results_are_kept_but_not_what_changes_them() -> None:
    assert layout.scope(FUNCTION, JOB | {"asset": "a", "id_column": "x"}) == SCOPE
    assert layout.scope(FUNCTION, JOB | {"code_version": "2"}) != SCOPE
    assert layout.scope(FUNCTION, JOB | {"input_columns": ["subject"]}) != SCOPE


def _bodies(n: int, start: int = 0) -> pl.DataFrame:
    ids = range(start, start + n)
    return pl.DataFrame({ID: list(ids), "body": [f"body {i}" for i in ids]})


def route(batch: pl.DataFrame) -> pl.DataFrame:
    return batch.select(ID, route=pl.col("body").str.to_uppercase())


def test_many_shards_writing_at_once_lose_nothing(storage: Storage) -> None:
    base_dir, options = storage
    results = ResultStore(open_store(base_dir, options), open_store(base_dir, options).path("rs"))
    # 8 shards of about 40 rows, two flushes each: every shard writes while the others do.
    data = _bodies(320)
    settings = engine_settings(checkpoint_interval=20)
    shards = 8
    errors: list[BaseException] = []
    start = threading.Barrier(shards)

    def shard(index: int) -> None:
        try:
            label = Scheme.of(f"{index:02d}-of-{shards:02d}")
            mine = data.filter(pl.Series(hashing.shard_of(data.get_column(ID), shards) == index))
            checkpoint = Checkpoint(open_store(base_dir, options), f"job/{index}")
            context = RunContext(results=results, function_fingerprint=FUNCTION, scheme=label)
            inputs = prepare(mine, settings, content=True)
            start.wait()
            run(route, inputs, checkpoint, settings, job=JOB, context=context)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=shard, args=(i,)) for i in range(shards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    wanted = results_of(data.get_column("body").to_list())
    found = results.lookup(SCOPE, wanted.select(layout.KEYS))
    assert found.sort(layout.KEYS).equals(wanted.sort(layout.KEYS))
    assert len(results.files(SCOPE)) > layout.BUCKET_BITS  # written by many shards, no lock


def test_a_second_run_takes_from_the_store_and_writes_the_rows_as_its_own(tmp_path: Any) -> None:
    store = open_store(str(tmp_path / "checkpoints"))
    results = ResultStore(store, store.path("rs"))
    settings = engine_settings(checkpoint_interval=16)
    context = RunContext(results=results, function_fingerprint=FUNCTION)
    first = prepare(_bodies(40), settings, content=True)
    run(route, first, Checkpoint(store, "first"), settings, job=JOB, context=context)

    calls: list[int] = []

    def counted(batch: pl.DataFrame) -> pl.DataFrame:
        calls.extend(batch.get_column(ID).to_list())
        return route(batch)

    second = prepare(_bodies(40, start=20), settings, content=True)
    checkpoint = Checkpoint(store, "second")
    result, stats = run(counted, second, checkpoint, settings, job=JOB, context=context)

    assert sorted(calls) == list(range(40, 60))
    assert (stats.rows_from_store, stats.rows_computed) == (20, 20)
    stored = checkpoint.load(ID).rows.sort(ID)
    assert stored.get_column(ID).to_list() == list(range(20, 60))
    assert stored.get_column("route").to_list() == [f"BODY {i}" for i in range(20, 60)]
    assert stored.get_column("_error").null_count() == 40
    assert result.height == 40


def test_a_run_without_content_keys_is_refused(tmp_path: Any) -> None:
    store = open_store(str(tmp_path / "checkpoints"))
    context = RunContext(results=ResultStore(store), function_fingerprint=FUNCTION)
    settings = engine_settings()

    with pytest.raises(ValueError, match="content=True"):
        run(
            route,
            prepare(_bodies(4), settings),
            Checkpoint(store, "x"),
            settings,
            job=JOB,
            context=context,
        )


def _aged(store: ResultStore, when: float, rows: pl.DataFrame) -> None:
    """``rows`` stored at ``when`` (seconds since the epoch): a file per bucket."""
    by_bucket = rows.with_columns(layout.bucket().alias("b")).partition_by("b", as_dict=True)
    for (index,), mine in by_bucket.items():
        store.write(layout.new_file(store.root, SCOPE, int(index), when), mine.drop("b"))  # type: ignore[call-overload]


def _bodies_of(start: int, n: int) -> pl.DataFrame:
    return results_of([f"body {i}" for i in range(start, start + n)])


DAY = 86_400.0


def test_clean_by_age_deletes_only_older_files(tmp_path: Any) -> None:
    store = ResultStore(open_store(str(tmp_path / "results")))
    now = 100 * DAY
    _aged(store, now - 40 * DAY, _bodies_of(0, 10))
    _aged(store, now - 2 * DAY, _bodies_of(10, 10))

    cleaned = upkeep.clean(store, older_than=30 * DAY, now=now)

    assert {layout.written_at(f.path) for f in cleaned.deleted} == {now - 40 * DAY}
    assert {layout.written_at(f.path) for f in store.files()} == {now - 2 * DAY}
    kept = store.lookup(SCOPE, _bodies_of(0, 20).select(layout.KEYS))
    assert sorted(kept.get_column("route").to_list()) == sorted(f"BODY {i}" for i in range(10, 20))


def test_clean_by_size_deletes_the_oldest_first_until_it_fits(tmp_path: Any) -> None:
    store = ResultStore(open_store(str(tmp_path / "results")))
    for day in (1, 3, 2):
        _aged(store, day * DAY, _bodies_of(day * 1000, 100))
    files = store.files()
    oldest = [f for f in files if layout.written_at(f.path) == DAY]
    fits = sum(f.size for f in files if f not in oldest)

    cleaned = upkeep.clean(store, max_bytes=fits, now=10 * DAY)

    assert cleaned.deleted == oldest and cleaned.kept_bytes == fits
    assert {layout.written_at(f.path) for f in store.files()} == {2 * DAY, 3 * DAY}


def test_a_merged_file_has_the_filter_of_every_result(tmp_path: Any) -> None:
    results = ResultStore(open_store(str(tmp_path / "results")))
    files = upkeep.MERGE_AT + 1
    everything = keys_in_bucket(files * 2_000, 3, seed=4)
    for i in range(files):
        _aged(results, (i + 1) * DAY, everything.slice(i * 2_000, 2_000))

    assert upkeep.clean(results, now=100 * DAY).merged == files

    (merged,) = results.files()
    meta = pq.read_metadata(merged.path)
    assert meta.num_rows == everything.height
    spans = key_filter.spans(meta, merged.size, 0)
    assert spans is not None and len(spans) == meta.num_row_groups
    before = results.store.usage()
    absent = keys_in_bucket(1_000, 3, seed=5)
    assert results.lookup(SCOPE, absent.select(layout.KEYS)).height == 0
    read = results.store.usage().since(before).bytes_read
    assert read <= _outside_row_groups(results, merged.path)
    found = results.lookup(SCOPE, everything.select(layout.KEYS))
    assert found.sort(layout.KEYS).equals(everything.sort(layout.KEYS))


def test_clean_merges_small_files_and_keeps_every_result(tmp_path: Any) -> None:
    store = ResultStore(open_store(str(tmp_path / "results")))
    files = upkeep.MERGE_AT + 2
    everything = _bodies_of(0, 30_000).filter(layout.bucket() == 0).head(files * 5)
    for i in range(files):
        _aged(store, (i + 1) * DAY, everything.slice(i * 5, 5))
    assert len(store.files()) == files

    cleaned = upkeep.clean(store, now=100 * DAY)

    assert cleaned.merged == files
    (merged,) = store.files()
    assert layout.written_at(merged.path) == files * DAY  # its newest result's
    found = store.lookup(SCOPE, everything.select(layout.KEYS))
    assert found.sort(layout.KEYS).equals(everything.sort(layout.KEYS))
    assert np.all(found.get_column("route").str.starts_with("BODY").to_numpy())


def test_a_store_that_cannot_be_written_leaves_the_run_and_its_results_intact(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(str(tmp_path / "checkpoints"))
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    results = ResultStore(open_store(str(tmp_path)), str(blocked / "results"))
    settings = engine_settings(checkpoint_interval=8)
    context = RunContext(results=results, function_fingerprint=FUNCTION)
    checkpoint = Checkpoint(store, "job")

    result, stats = run(
        route,
        prepare(_bodies(20), settings, content=True),
        checkpoint,
        settings,
        job=JOB,
        context=context,
    )

    assert result.get_column("_error").null_count() == 20 == stats.rows_computed
    assert checkpoint.load(ID).rows.height == 20
    assert "Could not add results to the result store" in caplog.text
