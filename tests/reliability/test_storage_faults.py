"""Storage faults end in a retry that succeeds or a clear StorageError, and never lose a stored row.

Any backend (local disk and S3) gets faults from a fault-injecting store
(``helpers/faulty_store.py``): a part write that fails once or keeps failing, a failed delete
after the merged file, a failed read at resume, a listing of the parts that misses recent writes
(at finalize, or at the start of a run: a gap in the flush numbers, or the newest part).
S3 faults also come from a real HTTP proxy on 127.0.0.1 in front of the moto server
(``helpers/fault_proxy.py``): ``503 SlowDown`` (S3's throttling), a request that hangs past the
client's read timeout, a PUT cut off half way, a listing that does not show recent writes. A full
local disk is an ``ENOSPC`` from the real write path. After each failure, a run without the fault
resumes: it computes only what was not stored.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import make_bucket
from helpers.fault_proxy import Fault, FaultProxy
from helpers.faulty_store import StoreFault, faulty
from helpers.rows import Storage

from checkpoint_assets.engine import Checkpoint, RunContext, Settings, open_store, prepare, run
from checkpoint_assets.engine.checkpoints import gaps as gaps_module
from checkpoint_assets.engine.errors import StorageError
from checkpoint_assets.engine.plan.inputs import Prepared
from checkpoint_assets.engine.storage import Store
from checkpoint_assets.engine.upkeep.repair import repair
from checkpoint_assets.engine.upkeep.verify import problems

ROWS = 40
SETTINGS = Settings(
    id_column="ticket_id",
    input_columns=("body",),
    checkpoint_interval=4,
    min_flush_seconds=0.0,  # a part every 4 rows on S3 too
    retry_delay_seconds=0.0,
)
PART_PUT = r"\.parquet\.parts/part-"
PARTS_LIST = r"list-type=2.*prefix=[^&]*\.parquet\.parts"


def _source(n: int = ROWS) -> pl.DataFrame:
    ids = list(range(n))
    return pl.DataFrame({"ticket_id": ids, "body": [f"b{i}" for i in ids]})


def _inputs(n: int = ROWS) -> Prepared:
    return prepare(_source(n), SETTINGS)


def _fn(calls: list[int]) -> Any:
    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        calls.extend(batch["ticket_id"].to_list())
        return batch.select("ticket_id", route=pl.col("body").str.to_uppercase())

    return fn


def _run(
    store: Store,
    calls: list[int] | None = None,
    settings: Settings = SETTINGS,
    logger: logging.Logger | None = None,
) -> pl.DataFrame:
    result, _ = run(
        _fn([] if calls is None else calls),
        _inputs(),
        Checkpoint(store, "job"),
        settings,
        job={"v": 1},
        context=RunContext(logger=logger),
    )
    return result


def _assert_complete(store: Store) -> None:
    checkpoint = Checkpoint(store, "job")
    merged, _ = checkpoint.read_merged()
    assert merged is not None
    assert sorted(merged["ticket_id"].to_list()) == list(range(ROWS))
    assert merged["route"].to_list() == [f"B{i}" for i in merged["ticket_id"]]
    assert checkpoint.list_parts() == ([], [])


# -- S3 through a faulty proxy ----------------------------------------------------------------


@pytest.fixture
def proxy(s3_server: str) -> Iterator[FaultProxy]:
    server = FaultProxy(s3_server)
    try:
        yield server
    finally:
        server.stop()


def _s3(proxy: FaultProxy, s3_server: str, **config: Any) -> Store:
    bucket = make_bucket(s3_server)
    options: dict[str, Any] = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": proxy.endpoint, "region_name": "us-east-1"},
    }
    if config:
        options["config_kwargs"] = config
    return open_store(f"s3://{bucket}/checkpoints", options)


def test_s3_slowdown_is_retried_with_backoff(proxy: FaultProxy, s3_server: str) -> None:
    store = _s3(proxy, s3_server)
    proxy.add(Fault("slowdown", "PUT", PART_PUT, times=2, skip=1))

    result = _run(store)

    assert [kind for _, _, kind in proxy.spent()] == ["slowdown", "slowdown"]
    assert result.height == ROWS
    _assert_complete(store)


def test_s3_persistent_slowdown_is_a_clear_error_and_a_rerun_resumes(
    proxy: FaultProxy, s3_server: str
) -> None:
    # botocore's back-off kept short (legacy mode sleeps up to 15 s over its five attempts)
    store = _s3(proxy, s3_server, retries={"mode": "standard", "total_max_attempts": 2})
    proxy.add(Fault("slowdown", "PUT", PART_PUT, times=10**6, skip=3))
    calls: list[int] = []

    with pytest.raises(StorageError) as failed:
        _run(store, calls)

    message = str(failed.value)
    assert "SlowDown" in message and "throttling" in message and "run again" in message
    assert len(proxy.spent()) >= 3  # botocore's attempts, then s3fs's own retry, with back-off
    proxy.faults.clear()
    again: list[int] = []
    _run(open_store(store.url, _options(store)), again)
    assert len(again) <= ROWS - 3 * SETTINGS.checkpoint_interval  # the 3 parts stored are kept
    assert not set(again) & set(calls[: 3 * SETTINGS.checkpoint_interval])
    _assert_complete(store)


def _options(store: Store) -> dict[str, Any]:
    return dict(store.fs.storage_options)


def test_s3_request_that_hangs_times_out_and_is_retried(proxy: FaultProxy, s3_server: str) -> None:
    store = _s3(proxy, s3_server, read_timeout=1)
    proxy.add(Fault("hang", "PUT", PART_PUT, times=1, skip=2, seconds=3.0))

    result = _run(store)

    assert [kind for _, _, kind in proxy.spent()] == ["hang"]
    assert result.height == ROWS
    _assert_complete(store)


def test_s3_put_cut_off_half_way_is_retried(proxy: FaultProxy, s3_server: str) -> None:
    store = _s3(proxy, s3_server)
    proxy.add(Fault("cut", "PUT", PART_PUT, times=1, skip=1))

    result = _run(store)

    assert [kind for _, _, kind in proxy.spent()] == ["cut"]
    assert result.height == ROWS
    _assert_complete(store)


def test_s3_puts_cut_off_every_time_are_a_clear_error_and_a_rerun_resumes(
    proxy: FaultProxy, s3_server: str
) -> None:
    # One attempt for botocore (no back-off of its own); s3fs still retries on its own.
    store = _s3(proxy, s3_server, retries={"mode": "standard", "total_max_attempts": 1})
    proxy.add(Fault("cut", "PUT", PART_PUT, times=10**6, skip=2))
    calls: list[int] = []

    with pytest.raises(StorageError) as failed:
        _run(store, calls)

    assert "cannot be reached or does not answer" in str(failed.value)
    proxy.faults.clear()
    again: list[int] = []
    _run(open_store(store.url, _options(store)), again)
    assert not set(again) & set(calls[: 2 * SETTINGS.checkpoint_interval])
    _assert_complete(store)


def test_a_stale_listing_at_finalize_is_listed_again_and_loses_nothing(
    proxy: FaultProxy, s3_server: str
) -> None:
    store = _s3(proxy, s3_server)
    # The first listing of the parts (at the start: none) is served again once, at finalize.
    proxy.add(Fault("stale", "GET", PARTS_LIST, times=1))

    result = _run(store)

    assert [kind for _, _, kind in proxy.spent()] == ["stale"]
    assert sorted(result["ticket_id"].to_list()) == list(range(ROWS))
    _assert_complete(store)


def test_a_listing_that_stays_stale_stops_finalize_before_it_merges_or_deletes(
    proxy: FaultProxy, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("checkpoint_assets.engine.checkpoints.gaps._RELIST_SECONDS", (0.01, 0.01))
    store = _s3(proxy, s3_server)
    proxy.add(Fault("stale", "GET", PARTS_LIST, times=10**6))
    checkpoint = Checkpoint(store, "job")

    with pytest.raises(StorageError) as failed:
        run(_fn([]), _inputs(), checkpoint, SETTINGS, job={"v": 1})

    assert "does not show" in str(failed.value) and "Nothing was merged or deleted" in str(
        failed.value
    )
    assert checkpoint.read_merged() == (None, 0)  # nothing merged without the missing parts
    proxy.faults.clear()
    calls: list[int] = []
    _run(open_store(store.url, _options(store)), calls)
    assert calls == []  # every row was in the parts the stale listing hid
    _assert_complete(store)


# -- a full local disk ------------------------------------------------------------------------


def _fill_disk_on(monkeypatch: pytest.MonkeyPatch, matches: str, after: int, times: int) -> None:
    """``os.fsync`` fails with ENOSPC for files whose name contains ``matches``: the
    ``times`` writes after the first ``after`` ones."""
    real = os.fsync
    seen = {"n": 0}

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if matches in name:
            seen["n"] += 1
            if after < seen["n"] <= after + times:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs /proc")
def test_a_full_disk_is_a_clear_error_and_a_rerun_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(str(tmp_path))
    _fill_disk_on(monkeypatch, ".parquet.parts/part-", after=3, times=10**6)
    calls: list[int] = []

    with pytest.raises(StorageError) as failed:
        _run(store, calls)

    message = str(failed.value)
    assert "no space left on the device" in message and "free some space" in message
    assert "part-" in message  # names the file it could not write
    leftovers = [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    assert leftovers == []  # no temporary file left behind on a full disk
    monkeypatch.undo()
    again: list[int] = []
    _run(open_store(str(tmp_path)), again)
    assert not set(again) & set(calls[: 3 * SETTINGS.checkpoint_interval])
    _assert_complete(store)


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs /proc")
def test_a_full_disk_at_finalize_keeps_the_last_rows_as_a_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(str(tmp_path))
    _fill_disk_on(monkeypatch, "job.parquet.tmp-", after=0, times=1)  # the merged file, once

    with pytest.raises(StorageError, match="no space left"):
        _run(store)

    calls: list[int] = []
    _run(open_store(str(tmp_path)), calls)
    assert calls == []  # every row was stored: the parts, and the last rows as a part
    _assert_complete(store)


# -- any backend, through a fault-injecting store -----------------------------------------------


def _failure(what: str) -> StorageError:
    return StorageError(f"Checkpoint storage error while {what}: injected.")


def _stored_ids(store: Store) -> set[int]:
    checkpoint = Checkpoint(store, "job")
    return set(checkpoint.load("ticket_id").rows["ticket_id"].to_list())


def test_a_part_write_that_fails_once_is_written_on_the_way_out(storage: Storage) -> None:
    store = faulty(open_store(*storage), StoreFault("put", PART_PUT, _failure("writing"), skip=2))
    calls: list[int] = []

    with pytest.raises(StorageError, match="injected"):
        _run(store, calls)

    assert _stored_ids(store) == set(calls)  # the flush before leaving wrote every computed row
    again: list[int] = []
    _run(open_store(*storage), again)
    assert not set(again) & set(calls) and len(again) == ROWS - len(calls)
    _assert_complete(store)


def test_part_writes_that_keep_failing_keep_what_was_stored(storage: Storage) -> None:
    failing = StoreFault("put", PART_PUT, _failure("writing"), skip=3, times=10**6)
    store = faulty(open_store(*storage), failing)
    calls: list[int] = []

    with pytest.raises(StorageError, match="injected"):
        _run(store, calls)

    stored = _stored_ids(store)  # the three parts written before the store started failing
    assert stored < set(calls) and len(stored) >= 3 * SETTINGS.checkpoint_interval
    again: list[int] = []
    _run(open_store(*storage), again)
    assert not set(again) & stored and sorted(stored | set(again)) == list(range(ROWS))
    _assert_complete(store)


def test_a_failed_delete_after_the_merged_file_loses_nothing(storage: Storage) -> None:
    store = faulty(open_store(*storage), StoreFault("delete", PART_PUT, _failure("deleting")))

    with pytest.raises(StorageError, match="injected"):
        _run(store)

    assert _stored_ids(store) == set(range(ROWS))  # in the merged file, parts not yet deleted
    calls: list[int] = []
    _run(open_store(*storage), calls)
    assert calls == []
    _assert_complete(store)


def test_a_failed_read_at_resume_changes_nothing(storage: Storage) -> None:
    _run(open_store(*storage))
    checkpoint = Checkpoint(open_store(*storage), "job")
    before = {f.path: checkpoint.store.get(f.path) for f in checkpoint.list_files()}
    store = faulty(open_store(*storage), StoreFault("get", r"job\.parquet$", _failure("reading")))

    with pytest.raises(StorageError, match="injected"):
        _run(store)

    after = {f.path: checkpoint.store.get(f.path) for f in checkpoint.list_files()}
    assert after == before  # the lock is released, nothing else was touched
    calls: list[int] = []
    _run(open_store(*storage), calls)
    assert calls == []


@pytest.mark.parametrize("times", [1, 10**6])
def test_a_stale_parts_listing_never_makes_finalize_lose_parts(
    storage: Storage, times: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("checkpoint_assets.engine.checkpoints.gaps._RELIST_SECONDS", (0.01, 0.01))
    store = faulty(open_store(*storage), StoreFault("list", r"\.parquet\.parts$", times=times))

    if times == 1:
        result = _run(store)
        assert sorted(result["ticket_id"].to_list()) == list(range(ROWS))
    else:
        with pytest.raises(StorageError, match="does not show"):
            _run(store)
        assert Checkpoint(store, "job").read_merged() == (None, 0)
        calls: list[int] = []
        _run(open_store(*storage), calls)
        assert calls == []
    _assert_complete(store)


class _Crash(BaseException):
    """The run stops (like a Ctrl-C): it flushes what it computed, then leaves."""


def _stop_at(store: Store, row: int) -> list[tuple[int, list[int]]]:
    """A run that stops at the batch holding ``row``, after flushing every batch before it;
    returns (flush, ids) of each part it left, in order."""
    route = _fn([])

    def stops(batch: pl.DataFrame) -> pl.DataFrame:
        if row in batch["ticket_id"]:
            raise _Crash()
        return route(batch)  # type: ignore[no-any-return]

    checkpoint = Checkpoint(store, "job")
    with pytest.raises(_Crash):
        run(stops, _inputs(), checkpoint, SETTINGS, job={"v": 1})
    parts = checkpoint.list_parts()[0]
    return [(p.first, sorted(checkpoint.read_file(p.path)["ticket_id"])) for p in parts]


def _part(n: int) -> str:
    """A pattern matching the name of the part of flush ``n`` alone."""
    return rf"^part-0*{n}-0*{n}-"


def _three_parts(storage: Storage) -> list[tuple[int, list[int]]]:
    """Parts of a run stopped at row 36: three at least (rows done meanwhile join a flush)."""
    parts = _stop_at(open_store(*storage), 36)
    assert len(parts) >= 3 and [n for n, _ in parts] == list(range(1, len(parts) + 1))
    assert sorted(i for _, ids in parts for i in ids) == list(range(36))
    return parts


@pytest.fixture
def pauses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pauses taken before listing again (none taken for real)."""
    taken: list[float] = []
    fake = types.SimpleNamespace(time=gaps_module.time.time, sleep=taken.append)
    monkeypatch.setattr(gaps_module, "time", fake)
    return taken


@pytest.mark.parametrize("times", [1, 10**6])
def test_a_listing_that_misses_a_part_seen_at_the_start_never_loses_it(
    storage: Storage, times: int, pauses: list[float]
) -> None:
    _stop_at(open_store(*storage), 12)
    assert _stored_ids(open_store(*storage)) == set(range(12))
    # The next run sees the parts when it starts; at finalize the listing misses part 1.
    hidden = StoreFault("list", r"\.parquet\.parts$", hide=_part(1), skip=1, times=times)
    store = faulty(open_store(*storage), hidden)
    calls: list[int] = []

    if times == 1:
        _run(store, calls)
    else:
        with pytest.raises(StorageError, match="does not show 1 part"):
            _run(store, calls)
        assert Checkpoint(store, "job").read_merged() == (None, 0)
        _run(open_store(*storage), calls)
    assert sorted(calls) == list(range(12, ROWS))
    _assert_complete(store)


# -- stale listings at the start of a run -------------------------------------------------------


def test_a_listing_stale_at_the_start_is_listed_again_and_nothing_is_computed_twice(
    storage: Storage, pauses: list[float]
) -> None:
    parts = _three_parts(storage)
    # The first listing of the next run misses part 2: flushes 1 and 3 with a gap between.
    store = faulty(open_store(*storage), StoreFault("list", r"\.parquet\.parts$", hide=_part(2)))
    calls: list[int] = []

    result = _run(store, calls)

    assert len(pauses) == 1  # one pause, one listing more
    assert sorted(calls) == list(range(36, ROWS))  # the rows of part 2 are not computed again
    assert sorted(result["ticket_id"].to_list()) == list(range(ROWS))
    assert len(parts[1][1]) > 0
    _assert_complete(store)


def test_a_gap_that_stays_stops_the_run_before_any_call_and_a_rerun_resumes(
    storage: Storage, pauses: list[float]
) -> None:
    _three_parts(storage)
    checkpoint = Checkpoint(open_store(*storage), "job")
    before = {f.path: checkpoint.store.get(f.path) for f in checkpoint.list_files()}
    hidden = StoreFault("list", r"\.parquet\.parts$", hide=_part(2), times=10**6)
    store = faulty(open_store(*storage), hidden)
    calls: list[int] = []

    with pytest.raises(StorageError) as failed:
        _run(store, calls)

    message = str(failed.value)
    assert "holds flush 2, though parts of later flushes are there" in message
    assert "lags behind its writes, or those parts were deleted" in message
    assert "neither taken as done nor computed again, and nothing was merged or" in message
    assert "Run again in a few minutes" in message and "checkpoint-assets repair" in message
    assert calls == []  # nothing paid for
    assert len(pauses) == len(gaps_module._RELIST_SECONDS)  # bounded: then it gives up
    after = {f.path: checkpoint.store.get(f.path) for f in checkpoint.list_files()}
    assert after == before  # the lock is released, nothing else was touched
    # Once the listing shows the part again, the run resumes.
    _run(open_store(*storage), calls)
    assert sorted(calls) == list(range(36, ROWS))
    _assert_complete(checkpoint.store)


def test_a_part_deleted_outside_the_package_stops_runs_until_repair_accepts_the_loss(
    storage: Storage, pauses: list[float]
) -> None:
    lost = _three_parts(storage)[1][1]
    checkpoint = Checkpoint(open_store(*storage), "job")
    (second,) = [p for p in checkpoint.list_parts()[0] if p.first == 2]
    checkpoint.store.delete([second.path])  # a lifecycle rule, or by hand

    with pytest.raises(StorageError, match="holds flush 2"):
        _run(open_store(*storage))
    (flagged,) = problems(checkpoint)
    assert "holds flush 2, though parts of later flushes are there" in flagged
    done = repair(Checkpoint(open_store(*storage), "job"))

    assert problems(checkpoint) == []
    assert done.missing == [(2, 2)]
    assert "no part held flush 2: their rows are computed again" in done.summary()
    calls: list[int] = []
    _run(open_store(*storage), calls)
    assert sorted(calls) == lost + list(range(36, ROWS))  # only what was lost
    _assert_complete(checkpoint.store)


def test_a_gap_left_by_a_quarantined_part_is_no_reason_to_list_again(
    storage: Storage, pauses: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    damaged = _three_parts(storage)[1][1]
    checkpoint = Checkpoint(open_store(*storage), "job")
    (second,) = [p for p in checkpoint.list_parts()[0] if p.first == 2]
    checkpoint.store.put(second.path, b"PAR1 damaged")
    # The next run moves part 2 aside, computes its rows again, then stops too: the gap stays
    # for the run after it.
    _stop_at(open_store(*storage), 38)
    assert 2 not in [p.first for p in checkpoint.list_parts()[0]]
    store = faulty(open_store(*storage))
    calls: list[int] = []

    with caplog.at_level(logging.WARNING):
        _run(store, calls, logger=logging.getLogger("stale-test"))

    assert pauses == []  # the quarantine folder tells why the gap is there
    assert store.listed.count(checkpoint.files.quarantine) <= 3  # start, finalize, cleanup
    assert "no part holds flush 2: damaged, moved aside" in caplog.text
    assert sorted(calls) == list(range(36, ROWS))
    assert damaged  # computed by the run that moved them aside
    _assert_complete(store)


def test_a_listing_that_misses_the_newest_part_costs_its_rows_twice_but_loses_none(
    storage: Storage, pauses: list[float]
) -> None:
    parts = _three_parts(storage)
    newest, again = parts[-1]
    # A listing that misses the newest part leaves no gap: nothing tells the run it exists. It
    # computes its rows again and writes its first part under the same flush number, holding
    # other rows (this run flushes every 8).
    hidden = StoreFault("list", r"\.parquet\.parts$", hide=_part(newest))
    store = faulty(open_store(*storage), hidden)
    calls: list[int] = []

    result = _run(store, calls, dataclasses.replace(SETTINGS, checkpoint_interval=8))

    assert pauses == []
    assert sorted(calls) == again + list(range(36, ROWS))  # the documented limit: paid twice
    assert sorted(result["ticket_id"].to_list()) == list(range(ROWS))
    _assert_complete(store)  # both parts of that number were read: no row is lost


@pytest.mark.parametrize("order", ["old first", "new first"])
def test_two_parts_under_one_flush_number_are_both_read(storage: Storage, order: str) -> None:
    # What a listing that missed the newest part leaves: the part a stopped run wrote, and the
    # part the next run wrote under the same number, holding other rows. Both names sort either
    # way, so one of the two orders would hide a part if either were skipped.
    checkpoint = Checkpoint(open_store(*storage), "job")
    hashes = _inputs().keys.select("ticket_id", "_input_hash")
    rows = _fn([])(_source()).join(hashes, on="ticket_id")
    stamped = rows.with_columns(_error=pl.lit(None, pl.String), _attempts=1, _seq=1)
    old, new = stamped.slice(0, 4), stamped.slice(0, 8)  # the new part holds rows 4 to 7 too
    names = ["0" * 12, "f" * 12] if order == "old first" else ["f" * 12, "0" * 12]
    for frame, tag in zip([old, new], names, strict=True):
        path = f"{checkpoint.files.parts}/part-{1:012d}-{1:012d}-{tag}.parquet"
        checkpoint.store.put(path, checkpoint.encode_part(frame))

    stored = checkpoint.load("ticket_id")

    assert sorted(stored.rows["ticket_id"].to_list()) == list(range(8))
