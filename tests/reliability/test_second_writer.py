"""One writer, always: a holder paused past its lease, and parts that vanish under a writer.

A real child process holds the lock and is paused with SIGSTOP while four of its calls are in
flight; another writer takes the lock over once the lease expired and finishes the checkpoint.
On SIGCONT the paused writer must start no call, and write, compact or delete no file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pytest
from helpers import paused_writer

from checkpoint_assets import LockHeldError
from checkpoint_assets.engine import Checkpoint, open_store, prepare, run
from checkpoint_assets.engine.checkpoints.compaction import COMPACT_AT

ROWS = 120
PAUSE_ID = 60  # calls of this id and later block: the writer is paused in them
LEASE_SECONDS = 3.0


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` (a bound on a
    broken run, not a figure measured)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def called(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_a_holder_paused_past_its_lease_is_taken_over_and_stops_without_a_write(
    tmp_path: Path,
) -> None:
    base_dir = tmp_path / "checkpoints"
    paid = tmp_path / "calls.txt"
    checkpoint = Checkpoint(open_store(str(base_dir)), "routed")
    child = subprocess.Popen(
        [
            sys.executable,
            paused_writer.__file__,
            str(base_dir),
            "routed",
            str(paid),
            str(PAUSE_ID),
            str(ROWS),
            str(LEASE_SECONDS),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )

    def stored() -> set[int]:
        return set(checkpoint.load("ticket_id").rows.get_column("ticket_id").to_list())

    def paused_in_calls() -> bool:
        blocked = [i for i in called(paid) if i >= PAUSE_ID]
        return len(blocked) == 4 and stored() == set(range(PAUSE_ID))

    try:
        # Four calls blocked, everything before them durable: the writer thread is idle.
        wait_for(paused_in_calls, "the writer to block in four calls")
        os.kill(child.pid, signal.SIGSTOP)
        expires = json.loads(checkpoint.store.get(checkpoint.files.lock))["expires"]
        time.sleep(max(0.0, expires - time.time()) + 0.1)  # the lease is wall-clock time
        taker_calls: list[int] = []

        def fn(batch: pl.DataFrame) -> pl.DataFrame:
            taker_calls.extend(batch.get_column("ticket_id").to_list())
            return paused_writer.answer(batch)

        settings = paused_writer.settings_of(LEASE_SECONDS)
        inputs = prepare(paused_writer.tickets(ROWS), settings)
        result, _ = run(fn, inputs, checkpoint, settings, job={"v": 1})
        files = snapshot(base_dir)
        paid_before = called(paid)
    finally:
        os.kill(child.pid, signal.SIGCONT)
    out, _ = child.communicate(timeout=120)

    assert result.height == ROWS and result["_error"].null_count() == ROWS
    assert out.startswith("LockHeldError: This run's lease of the lock"), out
    assert "ran out" in out and "starts no more calls and writes nothing more" in out
    assert snapshot(base_dir) == files  # nothing written, compacted or deleted after SIGCONT
    assert checkpoint.store.get_or_none(checkpoint.files.lock) is None  # released by the taker
    assert called(paid) == paid_before  # no call started after SIGCONT
    twice = set(paid_before) & set(taker_calls)
    assert twice == set(range(PAUSE_ID, PAUSE_ID + 4))  # the calls in flight at the pause
    assert len(twice) <= settings.loss_bound().held
    assert sorted(stored()) == list(range(ROWS))


def test_parts_compacted_away_by_another_writer_give_a_clear_error_and_lose_nothing(
    tmp_path: Path,
) -> None:
    store = open_store(str(tmp_path / "checkpoints"))
    checkpoint = Checkpoint(store, "routed")
    settings = paused_writer.settings_of(300.0)
    settings = dataclasses.replace(settings, max_concurrency=1, checkpoint_interval=1)
    inputs = prepare(paused_writer.tickets(80), settings)
    first = COMPACT_AT - 1  # parts left by interrupted runs: one flush short of compaction

    def interrupted_at_its_second_call() -> Callable[[pl.DataFrame], pl.DataFrame]:
        calls: list[int] = []

        def fn(batch: pl.DataFrame) -> pl.DataFrame:
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt  # the row done is flushed as the run leaves: one part
            return paused_writer.answer(batch)

        return fn

    for _ in range(first):
        with pytest.raises(KeyboardInterrupt):
            run(interrupted_at_its_second_call(), inputs, checkpoint, settings, job={"v": 1})
    assert len(checkpoint.list_parts()[0]) == first
    other = Checkpoint(store, "routed")  # another writer, which ignores the lock

    def races(batch: pl.DataFrame) -> pl.DataFrame:
        if int(batch.get_column("ticket_id")[0]) == first:
            other.finalize("ticket_id", None)  # merges every part and deletes them
        return paused_writer.answer(batch)

    with pytest.raises(LockHeldError) as raised:
        run(races, inputs, Checkpoint(store, "routed"), settings, job={"v": 1})

    assert "vanished while it was read: another writer compacted or finalized" in str(raised.value)
    assert raised.value.__cause__ is None  # said, not a raw FileNotFoundError
    done = checkpoint.load("ticket_id").rows.get_column("ticket_id").to_list()
    assert set(range(first + 1)) <= set(done)  # what both wrote is stored
