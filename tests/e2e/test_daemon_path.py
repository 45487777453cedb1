"""The daemon path end to end: `dagster dev` (webserver, daemon, code server) on 127.0.0.1 with a
temporary DAGSTER_HOME, driven through GraphQL as the UI drives it (definitions:
``tests/helpers/daemon_defs.py``). One session serves every scenario, and scenarios run side by
side: on two cores a run's start-up is what costs.

- A backfill of ``sharded``'s two shards: both runs go at once (each waits after its first
  flush until the test lets them go) and each touches only its own checkpoint's files (an audit
  hook in every process records each file opened, renamed, linked or removed:
  ``tests/helpers/file_audit``). The code location is reloaded (``reloadRepositoryLocation``)
  while both wait mid-shard: nothing is lost and nothing computed twice.
- A shard of ``stopped`` is terminated (``terminateRun``) after it flushed: the run is canceled
  with its finished rows stored, and its re-execution (``launchRunReexecution``, the UI's
  "Re-execute") resumes them, computing again at most the batch that was in flight.
- ``growing_schedule`` over a source that grows: a tick computes only the rows new since the
  last run (materialized in this process). A cron schedule ticks at most once a minute, so the
  test evaluates the schedule's tick itself and launches its run request through GraphQL with
  the schedule's tag, as the daemon does.
"""

from __future__ import annotations

import os
import shutil
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pytest
from dagster_graphql import ReloadRepositoryLocationStatus
from deploy_services import dagster_dev
from helpers import daemon_defs
from helpers.graphql import client, launch_backfill, reexecute

from checkpoint_assets import CheckpointIOManager
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.sharding.hashing import shard_of
from checkpoint_assets.engine.storage import open_store

TESTS = Path(__file__).resolve().parents[1]
LOCATION = "helpers.daemon_defs"  # a python_module location is named after its module
ROWS = 120
SECONDS_PER_CALL = "0.25"  # 15 calls per shard: a few seconds of work, flushed every call


@dataclass
class Session:
    port: int
    home: Path
    source: Path
    instance: dg.DagsterInstance
    log: Path

    @property
    def checkpoints(self) -> Path:
        return self.home / "checkpoints"

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 150) -> Any:
        deadline = time.monotonic() + timeout
        while not (result := check()):
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}; log:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.2)
        return result

    def runs(self, backfill_id: str) -> list[dg.DagsterRun]:
        return list(self.instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill_id})))

    def parts(self, asset: str, shard: str) -> list[Path]:
        return list((self.checkpoints / asset / "default" / f"{shard}.parquet.parts").glob("*"))

    def computed(self, asset: str) -> Counter[int]:
        """How many times each id was computed, over every process."""
        return Counter(
            int(line)
            for path in (self.home / "calls").glob(f"{asset}-*.txt")
            for line in path.read_text().split()
        )

    def stored(self, asset: str, name: str) -> pl.DataFrame:
        checkpoint = Checkpoint(open_store(str(self.checkpoints)), f"{asset}/default/{name}")
        return checkpoint.read_result("ticket_id", ["score"])

    def metadata(self, asset: str, run_id: str) -> dict[str, Any]:
        records = self.instance.fetch_materializations(dg.AssetKey(asset), limit=20).records
        event = next(r for r in records if r.run_id == run_id).asset_materialization
        assert event is not None
        return {k: v.value for k, v in event.metadata.items()}


def _source(rows: int) -> pl.DataFrame:
    return pl.DataFrame(
        {"ticket_id": range(rows), "body": [f"ticket {i} " + "x" * (i % 7) for i in range(rows)]}
    )


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    tmp = tmp_path_factory.mktemp("daemon")
    home = tmp / "home"
    (home / "calls").mkdir(parents=True)
    (home / "audit").mkdir()
    (home / "dagster.yaml").write_text(
        textwrap.dedent(
            """\
            telemetry:
              enabled: false
            run_coordinator:
              module: dagster._core.run_coordinator
              class: DefaultRunCoordinator
            """
        )
    )
    workspace = tmp / "workspace.yaml"
    workspace.write_text(
        f"load_from:\n  - python_module:\n      module_name: {LOCATION}\n"
        f"      working_directory: {TESTS}\n"
    )
    source = home / "source.parquet"
    _source(ROWS).write_parquet(source)
    path = os.pathsep.join(
        [str(TESTS / "helpers" / "file_audit"), str(TESTS), os.environ.get("PYTHONPATH", "")]
    )
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "PYTHONPATH": path,
        "DAEMON_SOURCE": str(source),
        "DAEMON_CALLS": str(home / "calls"),
        "DAEMON_SECONDS_PER_CALL": SECONDS_PER_CALL,
        "FILE_AUDIT_ROOT": str(home / "checkpoints") + "/",
        "FILE_AUDIT_LOG": str(home / "audit" / "files"),
    }
    log = tmp / "dagster_dev.log"
    with dg.DagsterInstance.from_config(str(home)) as instance:
        # The source, materialized here: the backfills read it.
        with _environ(DAEMON_SOURCE=str(source)):
            assert dg.materialize([daemon_defs.rows], instance=instance, resources=_io(home))
        started = time.monotonic()
        with dagster_dev(env, log, workspace) as port:
            print(f"\ndagster dev answered after {time.monotonic() - started:.0f} s")
            yield Session(port, home, source, instance, log)
    shutil.rmtree(tmp, ignore_errors=True)


def _io(home: Path) -> dict[str, Any]:
    return {"io_manager": CheckpointIOManager(base_dir=str(home / "checkpoints"))}


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    """``values`` in this process's environment for the block: what daemon_defs reads."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shards_at_once_a_reload_and_a_terminated_run_lose_and_repeat_nothing(
    session: Session,
) -> None:
    started = time.monotonic()
    shards = daemon_defs.SHARDS.get_partition_keys()
    sharded = launch_backfill(session.port, shards, "sharded")
    stopped = launch_backfill(session.port, [shards[0]], "stopped")
    gql = client(session.port)
    reloaded_at: float | None = None
    terminated: dg.DagsterRun | None = None
    retry_id: str | None = None

    def step() -> bool:
        """Act once each condition holds; True when every run is done."""
        nonlocal reloaded_at, terminated, retry_id
        runs = session.runs(sharded)
        running = [r for r in runs if r.status == dg.DagsterRunStatus.STARTED]
        if (
            reloaded_at is None
            and len(running) == 2
            and all(session.parts("sharded", s) for s in shards)
        ):
            reload = gql.reload_repository_location(LOCATION)
            assert reload.status == ReloadRepositoryLocationStatus.SUCCESS, reload.message
            reloaded_at = time.monotonic()
            (session.home / "calls" / "go").touch()  # both shards wait for it (daemon_defs)
        if terminated is None:
            for run in session.runs(stopped):
                if run.status == dg.DagsterRunStatus.STARTED and session.parts(
                    "stopped", shards[0]
                ):
                    gql.terminate_run(run.run_id)
                    terminated = run
        elif retry_id is None:
            run = session.instance.get_run_by_id(terminated.run_id)
            if run is not None and run.is_finished:
                retry_id = reexecute(session.port, terminated.run_id)
        retry = session.instance.get_run_by_id(retry_id) if retry_id else None
        return bool(
            len(runs) == 2 and all(r.is_finished for r in runs) and retry and retry.is_finished
        )

    session.wait("the backfills, the reload and the re-execution", step, timeout=240)
    print(f"backfills, reload, termination and re-execution: {time.monotonic() - started:.0f} s")
    assert reloaded_at is not None
    assert terminated is not None and retry_id is not None

    # The reload lost nothing: one successful run per shard, every row stored and computed once.
    runs = session.runs(sharded)
    assert sorted((r.tags["dagster/partition"], r.status) for r in runs) == [
        (s, dg.DagsterRunStatus.SUCCESS) for s in shards
    ]
    source = _source(ROWS)
    stored = pl.concat([session.stored("sharded", s) for s in shards])
    assert sorted(stored.get_column("ticket_id")) == list(range(ROWS))
    assert stored.get_column("_error").null_count() == ROWS
    expected = source.select("ticket_id", score=pl.col("body").str.len_chars())
    assert stored.sort("ticket_id").select("ticket_id", "score").equals(expected)
    assert session.computed("sharded") == Counter(range(ROWS))

    # The two shards ran at once, and each run's process touched only its own checkpoint.
    touched = _files_by_process(session.home / "audit", session.checkpoints / "sharded")
    assert len(touched) == 2, touched.keys()  # one process per run: the reload restarted none
    windows = [(min(t for t, _ in seen), max(t for t, _ in seen)) for seen in touched.values()]
    assert max(w[0] for w in windows) < min(w[1] for w in windows), windows  # they overlapped
    checkpoints = [{_checkpoint_of(p) for _, p in seen} for seen in touched.values()]
    assert sorted(len(c) for c in checkpoints) == [1, 1], checkpoints
    assert set.union(*checkpoints) == {f"default/{s}" for s in shards}

    # The terminated run was canceled with its finished rows flushed; its re-execution resumed
    # them and computed the rest, repeating at most the batch that was in flight.
    canceled = session.instance.get_run_by_id(terminated.run_id)
    retry = session.instance.get_run_by_id(retry_id)
    assert canceled is not None and canceled.status == dg.DagsterRunStatus.CANCELED
    assert retry is not None and retry.status == dg.DagsterRunStatus.SUCCESS
    assert retry.tags["dagster/partition"] == shards[0]
    metadata = session.metadata("stopped", retry_id)
    in_shard = source.filter(pl.Series(shard_of(source["ticket_id"], 2) == 0))
    assert metadata["rows_total"] == in_shard.height
    assert metadata["rows_resumed"] > 0, metadata
    assert metadata["rows_resumed"] + metadata["rows_computed"] == in_shard.height
    stored = session.stored("stopped", shards[0])
    assert sorted(stored.get_column("ticket_id")) == sorted(in_shard.get_column("ticket_id"))
    computed = session.computed("stopped")
    assert set(computed) == set(in_shard.get_column("ticket_id"))
    twice = sorted(i for i, n in computed.items() if n > 1)
    assert len(twice) <= daemon_defs.INTERVAL and max(computed.values()) <= 2, twice
    print(
        f"terminated run: {metadata['rows_resumed']} rows resumed, "
        f"{metadata['rows_computed']} computed on re-execution, {len(twice)} computed twice"
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_schedule_over_a_growing_source_computes_only_the_new_rows(session: Session) -> None:
    started = time.monotonic()
    gql = client(session.port)
    schedule = daemon_defs.growing_schedule

    def tick() -> dict[str, Any]:
        """One tick of the schedule, launched as the daemon launches it; the run's metadata."""
        context = dg.build_schedule_context(instance=session.instance)
        [request] = schedule.evaluate_tick(context).run_requests or []
        run_id = gql.submit_job_execution(
            "growing_job",
            run_config=request.run_config,
            tags={**request.tags, "dagster/schedule_name": schedule.name},
        )
        run = session.wait(
            "the scheduled run",
            lambda: (r := session.instance.get_run_by_id(run_id)) and r.is_finished and r,
        )
        assert run.status == dg.DagsterRunStatus.SUCCESS, session.log.read_text()[-3000:]
        return session.metadata("growing", run_id)

    # The last run, here in this process: every row of the source, as it is now.
    with _environ(DAEMON_SOURCE=str(session.source), DAEMON_CALLS=str(session.home / "calls")):
        last = dg.materialize(
            [daemon_defs.rows, daemon_defs.growing], instance=session.instance,
            resources=_io(session.home),
        )  # fmt: skip
    assert last.success
    [event] = last.asset_materializations_for_node("growing")
    assert event.metadata["rows_computed"].value == ROWS
    _source(ROWS + 40).write_parquet(session.source)  # new rows arrive

    ticked = tick()
    assert (ticked["rows_computed"], ticked["rows_resumed"]) == (40, ROWS)
    assert session.computed("growing") == Counter(range(ROWS + 40))
    print(f"a schedule tick: {time.monotonic() - started:.0f} s")


def _files_by_process(audit: Path, under: Path) -> dict[str, list[tuple[float, str]]]:
    """Per process (audit log file), the (time, path) of each access to a file ``under``."""
    prefix = str(under) + "/"
    out: dict[str, list[tuple[float, str]]] = {}
    for log in audit.glob("files.*"):
        for line in log.read_text().splitlines():
            at, _, path = line.split(" ", 2)
            if path.startswith(prefix):
                out.setdefault(log.name, []).append((float(at), path[len(prefix) :]))
    return out


def _checkpoint_of(path: str) -> str:
    """The checkpoint (``<tag>/<partition>``) a file of the asset's folder belongs to."""
    return path.split(".parquet", 1)[0]
