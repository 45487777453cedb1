"""Damaged files: each kind has one behaviour, and nothing damaged is ever taken as done.

Every test runs on local disk and on S3 (moto server over HTTP), on real Parquet files written by
real runs and then damaged: truncated, or with their end overwritten by garbage bytes.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.jobs import ASSET, Storage, build_job, route, run_logs, tickets

from checkpoint_assets import LockHeldError
from checkpoint_assets.engine import Checkpoint, RunContext, Settings, open_store, prepare, run
from checkpoint_assets.engine.checkpoints.meta import FORMAT_VERSION
from checkpoint_assets.engine.errors import CorruptCheckpointError, NewerFormatError
from checkpoint_assets.engine.loop import lock
from checkpoint_assets.engine.loop.lock import Lease
from checkpoint_assets.engine.rows import ERROR
from checkpoint_assets.engine.upkeep.repair import repair
from checkpoint_assets.engine.upkeep.verify import problems

SETTINGS = Settings(
    id_column="ticket_id",
    input_columns=("subject", "body"),
    checkpoint_interval=4,
    min_flush_seconds=0.0,
    retry_delay_seconds=0.0,
)


class Stop(BaseException):
    """Ends a run the hard way: the run flushes what is done and leaves parts behind."""


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def garbage(data: bytes) -> bytes:
    """The file's second half (its footer included) overwritten with random bytes."""
    half = len(data) // 2
    return data[:half] + random.Random(len(data)).randbytes(len(data) - half)


DAMAGE = {"truncated": truncated, "garbage": garbage}


def damage(checkpoint: Checkpoint, path: str, how: Callable[[bytes], bytes]) -> bytes:
    """Damage the file at ``path``; returns its content before."""
    before = checkpoint.store.get(path)
    checkpoint.store.put(path, how(before))
    return before


def engine_run(
    checkpoint: Checkpoint,
    df: pl.DataFrame,
    calls: list[int],
    *,
    stop_after: int | None = None,
    settings: Settings = SETTINGS,
    logger: logging.Logger | None = None,
) -> pl.DataFrame:
    """Run the engine over ``df`` recording computed ids in ``calls``; with ``stop_after``, stop
    hard once that many ids were computed (parts stay, nothing is merged)."""

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        if stop_after is not None and len(calls) >= stop_after:
            raise Stop
        calls.extend(batch.get_column("ticket_id").to_list())
        return route(batch)

    result, _ = run(
        fn,
        prepare(df, settings),
        checkpoint,
        settings,
        job={"v": 1},
        context=RunContext(logger=logger),
    )
    return result


def interrupted(storage: Storage, n: int, stop_after: int) -> tuple[Checkpoint, list[int]]:
    """A checkpoint left by an engine run stopped after ``stop_after`` rows: parts only."""
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), "routed/default/all")
    calls: list[int] = []
    with pytest.raises(Stop):
        engine_run(checkpoint, tickets(n), calls, stop_after=stop_after)
    return fresh(checkpoint), calls


def fresh(checkpoint: Checkpoint) -> Checkpoint:
    """The checkpoint as a new process sees it (a writer keeps the parts it wrote in memory)."""
    return Checkpoint(checkpoint.store, checkpoint.name)


def expected(n: int) -> pl.DataFrame:
    return route(tickets(n)).with_columns(pl.lit(None, pl.String).alias(ERROR))


def quarantined(checkpoint: Checkpoint) -> dict[str, bytes]:
    store = checkpoint.store
    return {f.name: store.get(f.path) for f in store.list(checkpoint.files.quarantine)}


# -- unmerged parts ----------------------------------------------------------------------------
@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_part_is_moved_aside_with_a_warning_and_its_rows_computed_again(
    storage: Storage, how: str
) -> None:
    checkpoint, _ = interrupted(storage, 24, 12)
    live, _ = checkpoint.list_parts()
    assert len(live) >= 2
    victim = live[1]
    kept = {i for p in live if p != victim for i in checkpoint.read_file(p.path)["ticket_id"]}
    before = damage(checkpoint, victim.path, DAMAGE[how])
    lost = set(pl.read_parquet(before).get_column("ticket_id").to_list())

    records: list[logging.LogRecord] = []
    logger = logging.getLogger(f"test-damaged-{how}")
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    second: list[int] = []
    result = engine_run(checkpoint, tickets(24), second, logger=logger)

    assert lost and lost <= set(second)  # computed again...
    assert sorted(second) == sorted(set(range(24)) - kept)  # ...and nothing else twice
    assert result.sort("ticket_id").select("ticket_id", "route", ERROR).equals(expected(24))
    moved = quarantined(checkpoint)
    assert list(moved.values()) == [DAMAGE[how](before)]  # kept as it was, byte for byte
    (name,) = moved
    assert name.startswith(victim.path.rsplit("/", 1)[1]) and name.endswith(".damaged")
    warning = next(r.getMessage() for r in records if r.levelno == logging.WARNING)
    assert checkpoint.store.display(victim.path) in warning
    assert f"{checkpoint.store.display(checkpoint.files.quarantine)}/{name}" in warning
    assert "computed again" in warning
    assert problems(checkpoint) == []
    assert checkpoint.list_parts() == ([], [])


def test_a_materialization_moves_a_damaged_part_aside_and_says_so_in_the_run_log(
    storage: Storage,
) -> None:
    job = build_job(storage, tickets(16))
    fails = {10}

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        if fails & set(batch.get_column("ticket_id").to_list()):
            raise Stop  # the run dies after flushing what it did
        return route(batch)

    broken = build_job(storage, tickets(16), fn=fn, instance=job.instance)
    with pytest.raises(Stop):
        broken.materialize()
    checkpoint = job.checkpoint()
    live, _ = checkpoint.list_parts()
    assert live
    before = damage(checkpoint, live[0].path, truncated)
    lost = set(pl.read_parquet(before).get_column("ticket_id").to_list())

    result = job.materialize()

    assert result.success
    done_before = (len(broken.calls) - 1) * 4  # its last batch raised
    assert set(job.computed_ids()) == lost | set(range(done_before, 16))
    logs = run_logs(result, job.instance)
    warning = next(m for m in logs if "moved it aside" in m)
    assert checkpoint.store.display(live[0].path) in warning
    assert checkpoint.store.display(checkpoint.files.quarantine) in warning
    stored = result.output_for_node(ASSET).sort("ticket_id")
    assert stored.select("ticket_id", "route", ERROR).equals(expected(16))
    assert len(quarantined(checkpoint)) == 1


def test_a_reader_without_the_lock_never_moves_a_damaged_part(storage: Storage) -> None:
    checkpoint, _ = interrupted(storage, 12, 8)
    part = checkpoint.list_parts()[0][0]
    damage(checkpoint, part.path, garbage)

    with pytest.raises(CorruptCheckpointError) as error:
        checkpoint.read_result("ticket_id", ["route"])

    assert checkpoint.store.display(part.path) in str(error.value)
    assert "next run" in error.value.remedy and "checkpoint-assets repair" in error.value.remedy
    assert quarantined(checkpoint) == {}
    assert checkpoint.store.get_or_none(part.path) is not None


def test_a_damaged_compacted_part_brings_back_the_parts_it_covered(storage: Storage) -> None:
    checkpoint, first = interrupted(storage, 24, 12)
    live, _ = checkpoint.list_parts()
    # A compaction killed after writing its part, before deleting its inputs, then damaged.
    frames = [checkpoint.read_file(p.path) for p in live]
    covering = checkpoint.write_part(pl.concat(frames), live[0].first, live[-1].last)
    damage(checkpoint, covering.path, truncated)
    checkpoint = fresh(checkpoint)
    calls: list[int] = []

    result = engine_run(checkpoint, tickets(24), calls, logger=logging.getLogger("test"))

    assert sorted(calls) == sorted(set(range(24)) - set(first))  # nothing computed twice
    assert result.sort("ticket_id").select("ticket_id", "route", ERROR).equals(expected(24))
    assert len(quarantined(checkpoint)) == 1


# -- the merged file -------------------------------------------------------------------------
@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_merged_file_stops_the_run_naming_verify_and_repair(
    storage: Storage, how: str
) -> None:
    job = build_job(storage, tickets(12))
    assert job.materialize().success
    checkpoint = job.checkpoint()
    damaged = damage(checkpoint, checkpoint.files.merged, DAMAGE[how])
    damaged = DAMAGE[how](damaged)
    calls = len(job.calls)

    result = job.materialize(raise_on_error=False)

    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    message = str(failure.step_failure_data.error)  # type: ignore[union-attr]
    base_dir = checkpoint.store.url
    assert f"Checkpoint file {checkpoint.url} is unreadable" in message
    assert f"checkpoint-assets verify {base_dir} {checkpoint.name}" in message
    assert f"checkpoint-assets repair {base_dir} {checkpoint.name}" in message
    assert len(job.calls) == calls  # nothing computed
    assert checkpoint.store.get(checkpoint.files.merged) == damaged  # nothing touched
    assert any("is unreadable" in p for p in problems(checkpoint))


def test_repair_rebuilds_from_readable_parts_and_the_next_run_computes_only_what_was_lost(
    storage: Storage,
) -> None:
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), "routed/default/all")
    engine_run(checkpoint, tickets(12), [])  # merged: ids 0..11
    grown: list[int] = []
    with pytest.raises(Stop):  # the input grew: parts with ids 12..23, then a hard stop
        engine_run(checkpoint, tickets(32), grown, stop_after=12)
    checkpoint = fresh(checkpoint)
    parts, _ = checkpoint.list_parts()
    bad_part = parts[0]
    lost_part = pl.read_parquet(damage(checkpoint, bad_part.path, garbage))
    merged_before = damage(checkpoint, checkpoint.files.merged, truncated)

    done = repair(checkpoint)

    display = checkpoint.store.display
    damaged = {display(checkpoint.files.merged), display(bad_part.path)}
    assert {m.path for m in done.moved} == damaged
    assert all(m.to.startswith(display(checkpoint.files.quarantine) + "/") for m in done.moved)
    assert all("is unreadable" in m.problem for m in done.moved)
    assert done.parts_merged == len(parts) - 1
    assert (done.rows_ok, done.rows_failed) == (12 - lost_part.height, 0)
    assert truncated(merged_before) in quarantined(checkpoint).values()
    assert problems(checkpoint) == []
    assert checkpoint.list_parts() == ([], [])
    assert checkpoint.store.get_or_none(checkpoint.files.lock) is None

    again: list[int] = []
    result = engine_run(checkpoint, tickets(32), again)
    kept = set(range(12, 24)) - set(lost_part.get_column("ticket_id").to_list())
    assert sorted(again) == sorted(set(range(32)) - kept)
    assert result.sort("ticket_id").select("ticket_id", "route", ERROR).equals(expected(32))


def test_repair_is_refused_while_a_live_run_holds_the_lock(storage: Storage) -> None:
    checkpoint, _ = interrupted(storage, 12, 8)
    damage(checkpoint, checkpoint.list_parts()[0][0].path, truncated)
    now = time.time()
    holder = {"token": "t", "run_id": "busy", "host": "elsewhere", "pid": 7}
    holder |= {"since": now, "expires": now + 3600}
    checkpoint.store.put(checkpoint.files.lock, json.dumps(holder).encode())
    files = {f.path for f in checkpoint.list_files()}

    with pytest.raises(LockHeldError, match="run busy"):
        repair(checkpoint)

    assert {f.path for f in checkpoint.list_files()} == files


# -- the meta file -----------------------------------------------------------------------------
@pytest.mark.parametrize("meta", ["garbage", "missing"])
def test_a_damaged_or_missing_meta_stops_the_run_and_repair_starts_the_checkpoint_again(
    storage: Storage, meta: str
) -> None:
    checkpoint, _ = interrupted(storage, 12, 8)
    engine_run(checkpoint, tickets(12), [])  # merged file and meta
    with pytest.raises(Stop):
        engine_run(checkpoint, tickets(20), [], stop_after=4)  # and a part
    checkpoint = fresh(checkpoint)
    files = checkpoint.data_files()
    assert len(files) == 2
    if meta == "garbage":
        checkpoint.store.put(checkpoint.files.meta, b'{"job_fingerprint": "ab')
    else:
        checkpoint.store.delete([checkpoint.files.meta])
    calls: list[int] = []

    with pytest.raises(CorruptCheckpointError) as error:
        engine_run(checkpoint, tickets(20), calls)

    assert calls == []
    what = "is unreadable" if meta == "garbage" else "is missing, but 2 other file(s)"
    assert f"Checkpoint file {checkpoint.store.display(checkpoint.files.meta)} {what}" in str(
        error.value
    )
    assert f"checkpoint-assets repair {checkpoint.store.url} {checkpoint.name}" in str(error.value)
    assert problems(checkpoint) == [str(error.value)]

    done = repair(checkpoint)

    assert done.meta_lost is not None and "only record of the job" in done.meta_lost
    moved = {m.path for m in done.moved}
    expect = {checkpoint.store.display(p) for p in files}
    if meta == "garbage":
        expect.add(checkpoint.store.display(checkpoint.files.meta))
    assert moved == expect
    assert len(quarantined(checkpoint)) == len(expect)  # kept, never deleted
    assert checkpoint.data_files() == []
    again: list[int] = []
    result = engine_run(checkpoint, tickets(20), again)
    assert sorted(again) == list(range(20))  # rows of an unknown job are never resumed
    assert result.sort("ticket_id").select("ticket_id", "route", ERROR).equals(expected(20))


def test_a_meta_of_an_older_format_resumes_and_is_written_again_in_the_current_one(
    tmp_path: Any,
) -> None:
    checkpoint, _ = interrupted((str(tmp_path / "checkpoints"), {}), 12, 8)
    engine_run(checkpoint, tickets(12), [])
    store = checkpoint.store
    older = json.loads(store.get(checkpoint.files.meta))
    older["format_version"] = 1
    del older["function_fingerprint"]  # the key format 2 added
    store.put(checkpoint.files.meta, json.dumps(older).encode())
    calls: list[int] = []

    engine_run(fresh(checkpoint), tickets(20), calls)

    assert sorted(calls) == list(range(12, 20))
    assert json.loads(store.get(checkpoint.files.meta))["format_version"] == FORMAT_VERSION


def test_a_meta_of_a_newer_format_stops_run_verify_and_repair_and_every_file_stays(
    tmp_path: Any,
) -> None:
    checkpoint, _ = interrupted((str(tmp_path / "checkpoints"), {}), 12, 8)
    engine_run(checkpoint, tickets(12), [])  # merged file and meta
    with pytest.raises(Stop):
        engine_run(checkpoint, tickets(20), [], stop_after=4)  # and a part
    checkpoint = fresh(checkpoint)
    store = checkpoint.store
    newer = json.loads(store.get(checkpoint.files.meta))
    newer["format_version"] = FORMAT_VERSION + 1
    newer["function_fingerprint"] = "a key this version does not know"
    store.put(checkpoint.files.meta, json.dumps(newer).encode())
    stale = f"{checkpoint.files.merged}.tmp-abcdef012345"  # what repair removes otherwise
    store.put(stale, b"half a file")
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    before = {f.path: store.get(f.path) for f in store.list_recursive(store.root)}
    calls: list[int] = []

    with pytest.raises(NewerFormatError) as error:
        engine_run(checkpoint, tickets(20), calls)

    assert calls == []
    message = str(error.value)
    assert (
        f"{store.display(checkpoint.files.meta)} was written by a newer version of "
        f"checkpoint-assets (format {FORMAT_VERSION + 1}; this version reads up to "
        f"{FORMAT_VERSION})"
    ) in message
    assert "Upgrade checkpoint-assets" in message
    assert problems(checkpoint) == [message]
    with pytest.raises(NewerFormatError):
        repair(checkpoint)
    assert {f.path: store.get(f.path) for f in store.list_recursive(store.root)} == before


# -- the lock file -----------------------------------------------------------------------------
def test_a_garbage_lock_is_held_by_an_unknown_writer_until_a_lease_has_passed(
    storage: Storage, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), "routed/default/all")
    checkpoint.store.put(checkpoint.files.lock, b"\x00\xffnot a lease")
    calls: list[int] = []

    with pytest.raises(LockHeldError) as held:
        engine_run(checkpoint, tickets(8), calls)

    assert calls == []
    assert "an unknown writer (the lock file is unreadable" in str(held.value)
    assert "delete the lock file" in held.value.remedy
    # A lease and a second later (S3 states a file's time to the second) by the leases' clock.
    later = SETTINGS.lease_seconds + 1.0
    monkeypatch.setattr(lock, "wall_clock", lambda: time.time() + later)
    with caplog.at_level(logging.WARNING, logger="checkpoint_assets"):
        result = engine_run(checkpoint, tickets(8), calls)
    assert sorted(calls) == list(range(8)) and result.height == 8
    assert any("Taking over" in r.message and "lease expired" in r.message for r in caplog.records)
    assert checkpoint.store.get_or_none(checkpoint.files.lock) is None


@pytest.mark.parametrize(
    "content",
    [
        b"[1, 2]",
        b'{"token": "t", "run_id": null, "host": "h", "pid": "x", "since": 0, "expires": 9}',
    ],
    ids=["json-list", "wrong-types"],
)
def test_a_lock_of_valid_json_but_no_lease_counts_as_unreadable(
    storage: Storage, content: bytes
) -> None:
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), "routed/default/all")
    checkpoint.store.put(checkpoint.files.lock, content)

    with pytest.raises(LockHeldError, match="unknown writer"):
        engine_run(checkpoint, tickets(4), [])


# -- stray temporary files -----------------------------------------------------------------------
def test_stray_temporary_files_are_ignored_and_old_ones_removed_at_finalize(
    tmp_path: Any,
) -> None:
    storage: Storage = (str(tmp_path / "checkpoints"), {})
    checkpoint, first = interrupted(storage, 16, 8)
    part = checkpoint.list_parts()[0][0]
    old = [f"{part.path}.tmp-0123456789ab", f"{checkpoint.files.merged}.tmp-abcdef012345"]
    new = [f"{checkpoint.files.meta}.tmp-00000000ffff"]
    for path in old + new:
        with open(path, "wb") as f:
            f.write(b"half a file")  # what a killed write leaves: garbage
    hour_ago = time.time() - 3600
    for path in old:
        os.utime(path, (hour_ago, hour_ago))
    assert len(checkpoint.list_parts()[0]) == 2  # never counted as a part
    assert problems(checkpoint) == []

    calls: list[int] = []
    result = engine_run(checkpoint, tickets(16), calls)

    assert sorted(calls) == sorted(set(range(16)) - set(first))
    assert result.height == 16
    assert not any(os.path.exists(p) for p in old)  # a killed writer's, long ago
    assert all(os.path.exists(p) for p in new)  # may be a write under way
    assert quarantined(checkpoint) == {}


def test_a_holder_whose_lock_file_turns_to_garbage_stops_writing(storage: Storage) -> None:
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), "routed/default/all")
    lease = Lease(checkpoint.store, checkpoint.files.lock, lease_seconds=60.0)
    lease.acquire()
    try:
        checkpoint.store.put(checkpoint.files.lock, b"garbage")

        lease.renew()

        with pytest.raises(LockHeldError, match="taken over by another writer"):
            lease.check()  # what a flush does first: nothing more is written
    finally:
        lease.release()
    assert checkpoint.store.get(checkpoint.files.lock) == b"garbage"  # not its lock to delete


# -- bytes changed inside a file's pages -------------------------------------------------------
def page_bytes(data: bytes) -> list[range]:
    """The byte ranges of every column chunk (its pages) of the Parquet file ``data``."""
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    chunks: list[range] = []
    for g in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            column = meta.row_group(g).column(c)
            start = column.data_page_offset
            if column.has_dictionary_page:
                start = min(start, column.dictionary_page_offset)
            chunks.append(range(start, start + column.total_compressed_size))
    return chunks


def overwritten(data: bytes, at: int, rng: random.Random) -> bytes:
    """``data`` with the 16 bytes from ``at`` replaced by other random bytes."""
    junk = bytes(b ^ (rng.randrange(255) + 1) for b in data[at : at + 16])
    return data[:at] + junk + data[at + 16 :]


def test_every_change_inside_a_merged_files_pages_stops_the_next_run(tmp_path: Any) -> None:
    """Sixteen bytes changed anywhere in the pages of a merged file (seeded: 50 places in its
    column chunks) never decode into other values: each next run stops naming verify and repair,
    and verify names the file."""
    settings = dataclasses.replace(SETTINGS, checkpoint_interval=500)
    checkpoint = Checkpoint(open_store(str(tmp_path)), "routed/default/all")
    engine_run(checkpoint, tickets(2000), [], settings=settings)
    path = checkpoint.files.merged
    sound = checkpoint.store.get(path)
    rng = random.Random(20261201)
    places = [i for chunk in page_bytes(sound) for i in chunk if i + 16 <= chunk.stop]
    assert len(places) > 1000

    for at in rng.sample(places, 50):
        checkpoint.store.put(path, overwritten(sound, at, rng))
        calls: list[int] = []
        with pytest.raises(CorruptCheckpointError) as error:
            engine_run(fresh(checkpoint), tickets(2000), calls, settings=settings)
        assert f"Checkpoint file {checkpoint.url} is unreadable" in str(error.value), at
        assert f"checkpoint-assets verify {tmp_path} {checkpoint.name}" in str(error.value)
        assert f"checkpoint-assets repair {tmp_path} {checkpoint.name}" in str(error.value)
        assert calls == []
        found = problems(fresh(checkpoint))
        assert any(checkpoint.url in p and "is unreadable" in p for p in found), (at, found)

    checkpoint.store.put(path, sound)
    calls = []
    assert engine_run(fresh(checkpoint), tickets(2000), calls, settings=settings).height == 2000
    assert calls == []


def test_a_merged_file_written_without_page_checksums_still_resumes(tmp_path: Any) -> None:
    """A merged file as older releases write it (polars, no page checksums) is read and resumes."""
    checkpoint = Checkpoint(open_store(str(tmp_path)), "routed/default/all")
    first = engine_run(checkpoint, tickets(24), [])
    path = checkpoint.files.merged
    new = checkpoint.store.get(path)
    old = io.BytesIO()
    pl.read_parquet(new).write_parquet(
        old, compression="zstd", compression_level=1, metadata=pl.read_parquet_metadata(new)
    )
    checkpoint.store.put(path, old.getvalue())
    assert pq.ParquetFile(pa.BufferReader(old.getvalue())).metadata.created_by.startswith("Polars")

    calls: list[int] = []
    again = engine_run(fresh(checkpoint), tickets(24), calls)

    assert calls == []
    assert again.sort("ticket_id").equals(first.sort("ticket_id"))
    assert problems(fresh(checkpoint)) == []


def test_every_change_inside_a_parts_pages_makes_it_unreadable(tmp_path: Any) -> None:
    """The same for a part (seeded: 50 places in its column chunks): each read of it fails, so the
    next run moves it aside (see the tests above)."""
    checkpoint, _ = interrupted((str(tmp_path), {}), 600, 500)
    part = max(checkpoint.list_parts()[0], key=lambda p: p.size)
    sound = checkpoint.store.get(part.path)
    rng = random.Random(20261202)
    places = [i for chunk in page_bytes(sound) for i in chunk if i + 16 <= chunk.stop]
    assert len(places) > 200

    for at in rng.sample(places, 50):
        checkpoint.store.put(part.path, overwritten(sound, at, rng))
        with pytest.raises(CorruptCheckpointError, match="is unreadable"):
            fresh(checkpoint).read_file(part.path)
