"""The lock under Dagster: a holder whose run the instance marks failed, yet still alive."""

from __future__ import annotations

import logging
import socket

import dagster as dg
import pytest
from helpers import hold_lock
from helpers.jobs import Storage, build_job, tickets

from checkpoint_assets.engine.loop import lock


def test_a_live_holder_whose_run_is_marked_failed_is_not_taken_over(
    storage: Storage,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    job = build_job(storage, tickets(10))
    first = job.materialize(limit=4)
    checkpoint = job.checkpoint()
    before = job.files()
    job.calls.clear()
    base_dir, options = storage
    # Alive, renewing its lease:
    holder = hold_lock.hold(base_dir, options, f"{checkpoint.name}.parquet.lock", first.run_id)
    try:
        run = job.instance.get_run_by_id(first.run_id)
        assert run is not None
        job.instance.report_run_failed(run, "marked failed while its step lives")
        monkeypatch.setattr(lock, "STOP_WAIT_SECONDS", 0.5)  # it never stops: it has no watch

        with caplog.at_level(logging.WARNING, logger="checkpoint_assets"):
            second = job.materialize(raise_on_error=False)
    finally:
        hold_lock.end(holder)

    assert not second.success
    message = _failure_message(second)
    assert "LockHeldError" in message
    assert f"run {first.run_id}, host {socket.gethostname()}, pid {holder.pid}" in message
    assert "Its run is failed, yet its process still renews the lease" in message
    assert f"end process {holder.pid}" in message
    assert not any("Taking over" in r.message for r in caplog.records)
    assert job.computed_ids() == []  # nothing paid twice
    assert {p: b for p, b in job.files().items() if not p.endswith(".lock")} == {
        p: b for p, b in before.items() if not p.endswith(".lock")
    }


def _failure_message(result: dg.ExecuteInProcessResult) -> str:
    failures = [e for e in result.all_events if e.is_step_failure]
    assert failures, "the run did not fail a step"
    error = failures[0].step_failure_data.error
    assert error is not None and error.cause is not None  # the engine's error, under Dagster's
    return error.cause.message
