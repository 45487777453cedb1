"""The lease, driven by an injected clock: when a holder stops trusting it, what it asks its
RunWatch, and what it never touches once it lost the lock."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_assets.engine import LockHeldError, open_store
from checkpoint_assets.engine.loop.lock import Holder, Lease
from checkpoint_assets.engine.storage import Store

LEASE = 300.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Watch:
    """A RunWatch whose answers the test sets."""

    def __init__(self) -> None:
        self.stop: str | None = None
        self.over: dict[str, str] = {}
        self.dead: list[tuple[Holder, str]] = []

    def stop_reason(self) -> str | None:
        return self.stop

    def run_over(self, run_id: str) -> str | None:
        return self.over.get(run_id)

    def holder_died(self, holder: Holder, reason: str) -> None:
        self.dead.append((holder, reason))


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(str(tmp_path / "checkpoints"))


def lease(store: Store, clock: Clock, watch: Watch | None = None, run_id: str = "r1") -> Lease:
    return Lease(
        store,
        store.path("c.parquet.lock"),
        run_id=run_id,
        lease_seconds=LEASE,
        clock=clock,
        watch=watch,
    )


def test_a_holder_stops_trusting_its_lease_a_tenth_before_it_expires(store: Store) -> None:
    clock = Clock()
    held = lease(store, clock)
    held.acquire()
    try:
        clock.now += 0.89 * LEASE
        assert held.halted() is None
        held.check()

        clock.now += 0.02 * LEASE  # as after a pause: the heartbeat never ran
        assert held.halted() is not None and "ran out" in held.halted()  # type: ignore[operator]
        with pytest.raises(LockHeldError, match="writes nothing more"):
            held.check()
        held.renew()  # a heartbeat waking now writes nothing
        written = store.get(held.path)
    finally:
        held.release()
    assert store.get(held.path) == written  # its own expired lock, left for a taker to judge


def test_a_holder_taken_over_neither_renews_nor_deletes_the_new_lock(store: Store) -> None:
    clock = Clock()
    held = lease(store, clock)
    held.acquire()
    clock.now += LEASE + 1  # paused past its lease
    taker = lease(store, clock, run_id="r2")
    taker.acquire()
    try:
        held.renew()
        assert held.lost is not None
        held.release()
        assert json.loads(store.get(held.path))["run_id"] == "r2"
    finally:
        taker.release()
    assert store.get_or_none(held.path) is None


def test_a_finished_run_is_no_evidence_while_its_holder_lives(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    watch = Watch()
    watch.over["r1"] = "failed"
    held = lease(store, clock)
    held.acquire()
    monkeypatch.setattr("checkpoint_assets.engine.loop.lock.STOP_WAIT_SECONDS", 0.0)
    try:
        with pytest.raises(LockHeldError) as refused:
            lease(store, clock, watch, run_id="r2").acquire()
    finally:
        held.release()
    assert "run r1" in str(refused.value) and "Its run is failed" in str(refused.value)
    assert watch.dead == []


def test_a_dead_holder_is_taken_over_and_its_watch_hears_why(store: Store) -> None:
    clock = Clock()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = Holder("t", "r1", socket.gethostname(), gone.pid, clock.now, clock.now + LEASE)
    store.put(store.path("c.parquet.lock"), json.dumps(dead.__dict__).encode())
    watch = Watch()
    taker = lease(store, clock, watch, run_id="r2")
    taker.acquire()
    taker.release()
    assert [(h.run_id, h.pid, why) for h, why in watch.dead] == [
        ("r1", gone.pid, f"process {gone.pid} is gone")
    ]


def test_a_watch_that_says_stop_halts_calls_but_not_writes(store: Store) -> None:
    clock = Clock()
    watch = Watch()
    held = lease(store, clock, watch)
    held.acquire()
    try:
        watch.stop = "its run r1 is canceled"
        held._ask_watch()  # what the heartbeat does every WATCH_SECONDS
        assert held.halted() == "its run r1 is canceled"
        held.check()  # it still holds the lock: it stores what is done
    finally:
        held.release()
    assert store.get_or_none(held.path) is None
