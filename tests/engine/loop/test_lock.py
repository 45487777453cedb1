"""One writer per checkpoint: a live holder is named, a dead one replaced."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import polars as pl
import pytest
from helpers import hold_lock
from helpers.rows import Storage, tickets

from checkpoint_assets import LockHeldError, OutageError
from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.loop import lock

SETTINGS = Settings(
    id_column="ticket_id", input_columns=("body",), min_flush_seconds=0.0, retry_delay_seconds=0.0
)


def _checkpoint(storage: Storage) -> Checkpoint:
    base_dir, options = storage
    return Checkpoint(open_store(base_dir, options), "routed")


def _run(checkpoint: Checkpoint, calls: list[int]) -> pl.DataFrame:
    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        calls.append(batch.height)
        return batch.select("ticket_id", route=pl.col("body"))

    result, _ = run(fn, prepare(tickets(10), SETTINGS), checkpoint, SETTINGS, job={"v": 1})
    return result


def _write_lock(checkpoint: Checkpoint, **holder: object) -> None:
    now = time.time()
    fields = {
        "token": uuid.uuid4().hex,
        "run_id": "run-of-someone-else",
        "host": socket.gethostname(),
        "pid": 1,
        "since": now - 60,
        "expires": now + 3600,
    }
    fields.update(holder)
    checkpoint.store.put(checkpoint.files.lock, json.dumps(fields).encode())


@pytest.fixture
def held_lock(storage: Storage) -> Iterator[tuple[Checkpoint, subprocess.Popen[str]]]:
    """The checkpoint's lock, held by a live child process as run ``holder-run-7``."""
    checkpoint = _checkpoint(storage)
    base_dir, options = storage
    child = hold_lock.hold(base_dir, options, f"{checkpoint.name}.parquet.lock", "holder-run-7")
    try:
        yield checkpoint, child
    finally:
        hold_lock.end(child)


def test_second_writer_is_refused_naming_the_holder(
    held_lock: tuple[Checkpoint, subprocess.Popen[str]],
) -> None:
    checkpoint, child = held_lock
    calls: list[int] = []

    with pytest.raises(LockHeldError) as raised:
        _run(checkpoint, calls)

    message = str(raised.value)
    assert "run holder-run-7" in message
    assert f"host {socket.gethostname()}" in message
    assert f"pid {child.pid}" in message
    assert "since " in message and " UTC" in message
    assert calls == []
    assert checkpoint.list_parts() == ([], [])


def test_the_writer_runs_once_the_holder_has_released(
    held_lock: tuple[Checkpoint, subprocess.Popen[str]],
) -> None:
    checkpoint, child = held_lock
    assert child.stdin is not None
    child.stdin.close()
    child.wait(timeout=30)
    calls: list[int] = []

    assert _run(checkpoint, calls).height == 10
    assert calls


def test_lock_of_a_dead_process_is_taken_over_with_a_warning(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = _checkpoint(storage)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _write_lock(checkpoint, pid=gone.pid)

    with caplog.at_level(logging.WARNING, logger="checkpoint_assets"):
        result = _run(checkpoint, [])

    assert result.height == 10
    assert any(
        "Taking over" in r.message and f"process {gone.pid} is gone" in r.message
        for r in caplog.records
    )
    assert checkpoint.store.get_or_none(checkpoint.files.lock) is None


def test_lock_with_an_expired_lease_is_taken_over_with_a_warning(
    storage: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = _checkpoint(storage)
    _write_lock(checkpoint, host="another-host", expires=time.time() - 5)

    with caplog.at_level(logging.WARNING, logger="checkpoint_assets"):
        result = _run(checkpoint, [])

    assert result.height == 10
    assert any("lease expired" in r.message for r in caplog.records)


def test_live_lease_on_another_host_is_respected(storage: Storage) -> None:
    checkpoint = _checkpoint(storage)
    _write_lock(checkpoint, host="another-host", pid=4242)
    calls: list[int] = []

    with pytest.raises(LockHeldError, match="host another-host, pid 4242"):
        _run(checkpoint, calls)

    assert calls == []


def test_lock_is_released_after_success_and_after_failure(storage: Storage) -> None:
    checkpoint = _checkpoint(storage)
    _run(checkpoint, [])
    assert checkpoint.store.get_or_none(checkpoint.files.lock) is None

    def endpoint_down(batch: pl.DataFrame) -> pl.DataFrame:
        raise ConnectionError("the endpoint is down")

    fresh = _checkpoint_named(checkpoint, "down")
    with pytest.raises(OutageError, match="endpoint is down"):
        run(endpoint_down, prepare(tickets(10), SETTINGS), fresh, SETTINGS, job={"v": 1})
    assert fresh.store.get_or_none(fresh.files.lock) is None


class _Seen(logging.Handler):
    """Sets ``event`` once a record holding ``text`` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


def _checkpoint_named(like: Checkpoint, name: str) -> Checkpoint:
    return Checkpoint(like.store, name)


def test_a_writer_whose_lock_was_taken_over_stops_and_leaves_the_new_lock_alone(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = _checkpoint(storage)
    settings = dataclasses.replace(SETTINGS, checkpoint_interval=2, lease_seconds=0.15)
    # The leases' clock stands still: the lease never runs out, however slow a renewal is on a
    # loaded machine, and the heartbeat still renews it every 0.05 s.
    now = time.time()
    monkeypatch.setattr(lock, "wall_clock", lambda: now)
    calls: list[int] = []
    seen = _Seen("was taken over by another writer")
    logger = logging.getLogger("checkpoint_assets")
    logger.addHandler(seen)

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        calls.append(batch.height)
        if len(calls) == 2:  # as if this run had been paused and another writer took over
            # Written again until the heartbeat sees it: a renewal in flight when it lands (its
            # read before, its write after) overwrites it, which a real takeover after expiry
            # never meets.
            for _ in range(20):
                _write_lock(checkpoint, host="another-host", pid=4242, run_id="the-taker")
                if seen.event.wait(timeout=1.0):
                    break
        return batch.select("ticket_id", route=pl.col("body"))

    try:
        with pytest.raises(LockHeldError, match=r"taken over by another writer \(run the-taker"):
            run(fn, prepare(tickets(10), settings), checkpoint, settings, job={"v": 1})
    finally:
        logger.removeHandler(seen)

    assert calls == [2, 2]  # it stopped at the flush after the takeover
    holder = json.loads(checkpoint.store.get(checkpoint.files.lock))
    assert (holder["run_id"], holder["host"]) == ("the-taker", "another-host")
    assert sorted(checkpoint.load("ticket_id").rows["ticket_id"]) == [0, 1]  # flushed before
