"""A step that outlives its run stops itself; a run whose step died is reported failed.

Real processes: `dagster asset materialize` runs a shard's step in a child process (the default
executor) against a SQLite instance in a temporary ``DAGSTER_HOME``. Every call appends its id
to a file as it starts, so a test counts the rows paid for, and any paid twice.

- A live run marked failed in the instance (``report_run_failed``, what run monitoring does to a
  run whose worker died): its step stops by itself, keeping what it computed; the same partition
  run again right away is not let in while it lives, then resumes. No row is paid twice.
- `dagster asset materialize` SIGKILLed mid-shard: its step sees its launcher gone, stores what
  it has, releases the lock, reports the run failed and exits; a rerun resumes.
- Both killed (the step too): the next run takes the lock over and reports the dead run failed.

The run after the killed or failed one runs in the test's process (``dg.materialize``, quick
calls): what these tests prove is about the processes before it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from helpers import orphan_defs
from helpers.jobs import ids_in_shard, tickets

from checkpoint_assets.engine import Checkpoint, open_store
from checkpoint_assets.engine.loop.lock import pid_alive

SHARD = "0-of-2"
DAGSTER_MATERIALIZE = (sys.executable, "-m", "dagster", "asset", "materialize", "-f")
ROWS = 240


@dataclass
class Home:
    """A Dagster home with the source materialized, and where calls are counted."""

    path: Path
    env: dict[str, str]
    calls: Path
    instance: dg.DagsterInstance
    logs: dict[int, Path] = field(default_factory=dict)  # each process's output, by pid

    def materialize(self, **popen: object) -> subprocess.Popen[str]:
        """`dagster asset materialize` of the shard, started (not waited for)."""
        log = self.path / f"materialize-{time.monotonic_ns()}.log"
        process = subprocess.Popen(
            [
                *DAGSTER_MATERIALIZE,
                orphan_defs.__file__,
                "--select",
                "slow",
                "--partition",
                SHARD,
            ],
            env=self.env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            text=True,
            **popen,  # type: ignore[call-overload]
        )
        self.logs[process.pid] = log
        return process

    def rerun(self) -> dg.ExecuteInProcessResult:
        """The shard run again in this process (its calls quick): what the tests prove is
        about the processes before it, so this run needs no process of its own."""
        with pytest.MonkeyPatch.context() as env:
            env.setenv("ORPHAN_CALLS", str(self.calls))
            env.setenv("ORPHAN_SECONDS_PER_CALL", "0.01")
            return dg.materialize(
                [orphan_defs.rows, orphan_defs.slow],
                selection=[orphan_defs.slow],
                partition_key=SHARD,
                instance=self.instance,
                resources=orphan_defs.defs.resources,
                raise_on_error=False,
            )

    def output(self, process: subprocess.Popen[str]) -> str:
        return self.logs[process.pid].read_text()

    def run_logs(self, result: dg.ExecuteInProcessResult) -> list[str]:
        return [e.message for e in self.instance.all_logs(result.run_id) if e.message]

    def paid(self) -> Counter[int]:
        """How many times each id was called, over every process so far."""
        found: Counter[int] = Counter()
        for path in self.calls.glob("*.txt"):
            found.update(int(line) for line in path.read_text().split())
        return found

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(open_store(str(self.path / "checkpoints")), f"slow/default/{SHARD}")

    def holder(self) -> dict[str, object] | None:
        checkpoint = self.checkpoint()
        data = checkpoint.store.get_or_none(checkpoint.files.lock)
        return None if data is None else json.loads(data)

    def run_of(self, run_id: str) -> dg.DagsterRun:
        run = self.instance.get_run_by_id(run_id)
        assert run is not None
        return run

    def failure_message(self, run_id: str) -> str:
        records = self.instance.get_records_for_run(
            run_id, of_type=dg.DagsterEventType.RUN_FAILURE
        ).records
        assert records, f"run {run_id} has no failure event"
        return "\n".join(r.event_log_entry.message for r in records)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Home]:
    path = tmp_path / "dagster_home"
    path.mkdir()
    (path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    calls = tmp_path / "calls"
    calls.mkdir()
    source = tmp_path / "rows.parquet"
    tickets(ROWS).write_parquet(source)
    env = dict(os.environ)
    env.update(
        DAGSTER_HOME=str(path),
        ORPHAN_SOURCE=str(source),
        ORPHAN_CALLS=str(calls),
        ORPHAN_SECONDS_PER_CALL="0.2",  # a shard takes 12 s: killed well before its end
        # The tests read a step's last log lines from the console. Dagster copies them there
        # with `tail -F`, stopped when the step ends: give it a second to copy them first.
        DAGSTER_COMPUTE_LOG_TAIL_WAIT_AFTER_FINISH="1",
    )
    monkeypatch.setenv("DAGSTER_HOME", str(path))
    monkeypatch.setenv("ORPHAN_SOURCE", str(source))
    with dg.DagsterInstance.get() as instance:
        # The source in process: only the shard's runs need processes of their own.
        loaded = dg.materialize(
            [orphan_defs.rows], instance=instance, resources=orphan_defs.defs.resources
        )
        assert loaded.success
        yield Home(path, env, calls, instance)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 180.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` (a bound on a
    broken run, not a figure measured)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def mid_shard(home: Home) -> dict[str, object]:
    """Wait until the shard's step holds the lock and has paid for 20 rows; its lock."""
    wait_for(lambda: home.holder() is not None and sum(home.paid().values()) >= 20, "20 calls")
    holder = home.holder()
    assert holder is not None
    return holder


def shard_ids() -> list[int]:
    return sorted(ids_in_shard(tickets(ROWS), int(SHARD.split("-")[0]), 2))


def stored_ids(home: Home) -> list[int]:
    rows = home.checkpoint().load("ticket_id").rows
    return sorted(rows.filter(pl.col("_error").is_null()).get_column("ticket_id").to_list())


@pytest.mark.slow
def test_a_live_run_marked_failed_stops_its_step_and_no_row_is_paid_twice(home: Home) -> None:
    first = home.materialize()
    holder = mid_shard(home)
    run = home.run_of(str(holder["run_id"]))
    assert run.status == dg.DagsterRunStatus.STARTED

    home.instance.report_run_failed(run, "Marked failed while its step lives.")
    second = home.rerun()  # while the first step lives: it waits for the lock
    assert second.success, home.run_logs(second)
    assert first.wait(timeout=300) != 0

    out = home.output(first)
    assert f"stopped by itself: its run {run.run_id} is failed" in out
    paid = home.paid()
    twice = sorted(i for i, n in paid.items() if n > 1)
    said = [line for line in home.run_logs(second) if "slow 0-of-2: " in line]
    print(f"\nrows paid: {sum(paid.values())}, ids: {len(paid)}, paid twice: {twice}")
    print("the second run said:", *said[:3], sep="\n")
    assert twice == []
    assert sorted(paid) == shard_ids() == stored_ids(home)
    assert home.holder() is None


@pytest.mark.slow
def test_a_killed_materialize_leaves_no_step_running_and_a_rerun_resumes(home: Home) -> None:
    launcher = home.materialize(start_new_session=True)
    holder = mid_shard(home)
    step = int(str(holder["pid"]))
    assert step != launcher.pid and holder["launcher"] == launcher.pid  # the step is its child

    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=60)
    wait_for(lambda: not pid_alive(step), "the orphaned step to stop itself")

    assert home.holder() is None  # it released the lock
    run = home.run_of(str(holder["run_id"]))
    assert run.status == dg.DagsterRunStatus.FAILURE
    message = home.failure_message(run.run_id)
    assert f"the process that launched this step (pid {launcher.pid}) is gone" in message
    before = sum(home.paid().values())
    rerun = home.rerun()
    assert rerun.success, home.run_logs(rerun)
    paid = home.paid()
    assert sum(paid.values()) - before == len(shard_ids()) - before  # it resumed
    assert max(paid.values()) == 1  # the step stored every row it paid for before it exited
    assert sorted(paid) == shard_ids() == stored_ids(home)


def test_a_run_whose_step_died_with_its_launcher_is_reported_failed_by_the_next(
    home: Home,
) -> None:
    launcher = home.materialize(start_new_session=True)
    holder = mid_shard(home)
    step = int(str(holder["pid"]))

    os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and its step
    launcher.wait(timeout=60)
    wait_for(lambda: not pid_alive(step), "the step to die")
    run = home.run_of(str(holder["run_id"]))
    assert run.status == dg.DagsterRunStatus.STARTED  # nothing else would ever end it

    rerun = home.rerun()
    assert rerun.success, home.run_logs(rerun)

    run = home.run_of(run.run_id)
    assert run.status == dg.DagsterRunStatus.FAILURE
    message = home.failure_message(run.run_id)
    assert f"(pid {step} on " in message and "died holding the checkpoint lock" in message
    assert f"process {step} is gone" in message
    assert stored_ids(home) == shard_ids()
