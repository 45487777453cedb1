"""failed_partitions_sensor: retries failed partitions with a budget, through a real instance.

The sensor is evaluated with ``build_sensor_context`` against a SQLite instance holding real runs
(``dg.materialize(..., raise_on_error=False)``); each run it requests is executed the way the
daemon would (same partition, same tags). One test runs the real ``dagster-daemon``.

The sensor reads the instance, not the checkpoints: the first test runs on local disk and on S3,
the others on local disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pytest
import sqlalchemy
from helpers.jobs import Job, Storage, build_job, ids_in_shard, poisoned, tickets

from checkpoint_assets import (
    CheckpointIOManager,
    checkpointed_asset,
    failed_partitions_sensor,
    shard_partitions,
)
from checkpoint_assets.integration.watch.sensor import (
    RETRY_ATTEMPT_TAG,
    RETRY_OF_TAG,
    SensorState,
    retry_due,
)

SHARDS = shard_partitions(4)
KEYS = SHARDS.get_partition_keys()
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    yield dg.DagsterInstance.ephemeral()


class Ticker:
    """Evaluates a sensor tick after tick, carrying its cursor, as the daemon does."""

    def __init__(self, job: Job, sensor: dg.SensorDefinition) -> None:
        self.job = job
        self.sensor = sensor
        self.cursor: str | None = None
        self.defs = dg.Definitions(
            assets=[job.source, job.asset], sensors=[sensor], resources=job.resources()
        )

    def tick(self) -> tuple[list[dg.RunRequest], str]:
        context = dg.build_sensor_context(
            instance=self.job.instance, cursor=self.cursor, definitions=self.defs
        )
        data = self.sensor.evaluate_tick(context)
        self.cursor = data.cursor
        return list(data.run_requests or []), data.skip_message or ""

    def launch(self, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
        """Execute a requested run: the requested partition with the request's tags."""
        return dg.materialize(
            [self.job.source, self.job.asset],
            instance=self.job.instance,
            resources=self.job.resources(),
            partition_key=request.partition_key,
            tags=request.tags,
            raise_on_error=False,
        )

    def budgets(self) -> dict[str, int]:
        return {k: b.attempts for k, b in SensorState.from_json(self.cursor).budgets.items()}


def failing_job(
    storage: Storage, instance: dg.DagsterInstance, shard: int, rows: int = 40, **kw: Any
) -> tuple[Job, set[int]]:
    """A job of ``SHARDS`` over ``rows`` tickets whose function fails on the first row of shard
    ``shard``, and the set of failing ids (a test may change it); ``kw`` for ``build_job``."""
    df = tickets(rows)
    poison = {ids_in_shard(df, shard, 4)[0]}
    fn = poisoned(poison)
    return build_job(storage, df, fn=fn, partitions_def=SHARDS, instance=instance, **kw), poison


def test_sensor_requests_each_failed_partition_max_retries_times_then_gives_up(
    storage: Storage, instance: dg.DagsterInstance
) -> None:
    df = tickets(80)
    in_one, in_three = ids_in_shard(df, 1, 4), ids_in_shard(df, 3, 4)
    poison = {in_one[0], in_three[0]}
    job = build_job(storage, df, fn=poisoned(poison), partitions_def=SHARDS, instance=instance)
    for key in KEYS:
        job.materialize(key, raise_on_error=False)
    ticker = Ticker(job, failed_partitions_sensor(job.asset, max_retries=3, backoff_seconds=0))

    requested: Counter[str] = Counter()
    attempts: dict[str, list[str]] = {}
    skip = ""
    for _ in range(10):  # bounded: 3 retries each need 4 ticks
        requests, skip = ticker.tick()
        if not requests:
            break
        for request in requests:
            assert request.partition_key is not None
            requested[request.partition_key] += 1
            attempts.setdefault(request.partition_key, []).append(request.tags[RETRY_ATTEMPT_TAG])
            assert request.tags[RETRY_OF_TAG]
            assert not ticker.launch(request).success  # the cause is not fixed: fails again

    assert requested == {"1-of-4": 3, "3-of-4": 3}
    assert attempts == {"1-of-4": ["1", "2", "3"], "3-of-4": ["1", "2", "3"]}
    assert "Gave up on 2 partition(s)" in skip and "1-of-4, 3-of-4" in skip
    assert ticker.tick() == ([], skip)  # and it stays quiet

    # The cause of shard 1 is fixed and it is materialized by hand: its budget is reset ...
    poison.discard(in_one[0])
    assert job.materialize("1-of-4").success
    requests, _ = ticker.tick()
    assert requests == []
    assert ticker.budgets() == {"3-of-4": 3}
    # ... so a new failure of it is retried again, while shard 3 stays given up.
    poison.add(in_one[1])
    assert not job.materialize("1-of-4", raise_on_error=False, resume=False).success
    requests, _ = ticker.tick()
    assert [(r.partition_key, r.tags[RETRY_ATTEMPT_TAG]) for r in requests] == [("1-of-4", "1")]


@pytest.mark.parametrize("storage", ["local"], indirect=True)
@pytest.mark.parametrize("retry_failed", [True, False])
def test_partitions_with_failed_rows_are_retried_while_retry_failed_is_on(
    storage: Storage, instance: dg.DagsterInstance, retry_failed: bool
) -> None:
    df = tickets(80)
    bad = ids_in_shard(df, 2, 4)[0]
    poison = {bad}
    job = build_job(
        storage,
        df,
        fn=poisoned(poison),
        partitions_def=SHARDS,
        instance=instance,
        max_failed_fraction=0.5,
        retry_failed=retry_failed,
    )
    for key in KEYS:
        assert job.materialize(key).success  # one failed row is tolerated
    ticker = Ticker(job, failed_partitions_sensor(job.asset, backoff_seconds=0))

    requests, skip = ticker.tick()

    if not retry_failed:
        assert requests == [] and skip.startswith("No failed partitions")
        return
    assert [r.partition_key for r in requests] == ["2-of-4"]
    poison.clear()
    job.calls.clear()
    assert ticker.launch(requests[0]).success
    assert job.computed_ids() == [bad]  # the retry computed only the failed row
    requests, skip = ticker.tick()
    assert requests == [] and skip.startswith("No failed partitions")
    assert ticker.budgets() == {}


@pytest.mark.parametrize("storage", ["local"], indirect=True)
def test_a_run_made_in_process_is_the_sensors_though_tagged_for_dagsters_retries(
    storage: Storage,
) -> None:
    # As `dagster asset materialize` runs: Dagster tags them for its run retries, and its daemon
    # then declines them (no code location to launch them from). A run Dagster does retry is
    # left to it: e2e/test_backfill_retries.py.
    overrides = {"run_retries": {"enabled": True, "max_retries": 2}}
    with dg.instance_for_test(overrides=overrides) as instance:
        job, _ = failing_job(storage, instance, 1)
        assert not job.materialize("1-of-4", raise_on_error=False).success
        failed = instance.get_runs(limit=1)[0]
        assert failed.tags.get("dagster/will_retry") == "true"  # set by Dagster's run retries
        assert failed.remote_job_origin is None
        ticker = Ticker(job, failed_partitions_sensor(job.asset, backoff_seconds=0))
        requests, _ = ticker.tick()
        assert [r.partition_key for r in requests] == ["1-of-4"]


@pytest.mark.parametrize("storage", ["local"], indirect=True)
def test_a_retry_waits_for_its_backoff(storage: Storage, instance: dg.DagsterInstance) -> None:
    job, _ = failing_job(storage, instance, 0)
    assert not job.materialize("0-of-4", raise_on_error=False).success
    ticker = Ticker(job, failed_partitions_sensor(job.asset, backoff_seconds=3600))

    requests, skip = ticker.tick()

    assert requests == []
    assert "1 failed partition(s) of routed wait for their backoff" in skip
    assert [retry_due(1000.0, n, 60.0) for n in range(4)] == [1060.0, 1120.0, 1240.0, 1480.0]
    assert retry_due(1000.0, 5, 0.0) == 1000.0  # backoff_seconds=0: the next tick


@pytest.mark.parametrize("storage", ["local"], indirect=True)
@pytest.mark.parametrize("planned", ["per partition", "per range"])
def test_a_failed_ranged_backfill_run_is_retried_for_its_failed_shard_only(
    storage: Storage, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch, planned: str
) -> None:
    if planned == "per range":  # one planned event per range: the sensor follows the run
        monkeypatch.setenv("DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS", "true")
    single_run = dg.BackfillPolicy.single_run()
    job, poison = failing_job(storage, instance, 1, rows=80, backfill_policy=single_run)
    ranged = dg.materialize(
        [job.source, job.asset],
        instance=instance,
        resources=job.resources(),
        tags={
            "dagster/asset_partition_range_start": "0-of-4",
            "dagster/asset_partition_range_end": "3-of-4",
        },
        raise_on_error=False,
    )
    assert not ranged.success
    run = instance.get_run_by_id(ranged.run_id)
    assert run is not None and "dagster/partition" not in run.tags

    # The other shards materialized as they ended: only the failed one is retried.
    assert sorted(instance.get_materialized_partitions(job.asset.key)) == [KEYS[0], *KEYS[2:]]
    ticker = Ticker(job, failed_partitions_sensor(job.asset, backoff_seconds=0))
    requests, _ = ticker.tick()
    assert [r.partition_key for r in requests] == [KEYS[1]]
    assert {r.tags[RETRY_OF_TAG] for r in requests} == {ranged.run_id}
    assert SensorState.from_json(ticker.cursor).ranged == (
        {ranged.run_id} if planned == "per range" else set()
    )
    bad = poison.pop()  # the cause is fixed
    job.calls.clear()
    for request in requests:
        assert ticker.launch(request).success
    # The ranged run finished every other shard before failing: the retries compute one row.
    assert job.computed_ids() == [bad]

    requests, skip = ticker.tick()
    assert requests == [] and skip.startswith("No failed partitions")
    assert ticker.budgets() == {}
    assert SensorState.from_json(ticker.cursor).ranged == set()  # made good: no longer watched


@dg.op
def step() -> None:
    pass


@dg.job
def other_job() -> None:
    step()


@pytest.mark.parametrize("storage", ["local"], indirect=True)
@pytest.mark.parametrize("shards", ["range", "one"])
def test_a_failed_run_is_retried_however_many_runs_of_other_jobs_failed_since(
    storage: Storage, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch, shards: str
) -> None:
    # One planned event per run, a subset of partitions (as this setting makes the instance
    # emit): Dagster's partition status then does not show them as failed, only the run does.
    monkeypatch.setenv("DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS", "true")
    single_run = dg.BackfillPolicy.single_run()
    job, _ = failing_job(storage, instance, 1, backfill_policy=single_run)
    ticker = Ticker(job, failed_partitions_sensor(job.asset, backoff_seconds=0))
    assert ticker.tick()[0] == []  # a tick before: the sensor has a cursor
    covered = [KEYS[1]]  # in a range, the other shards materialized as they ended
    failed = dg.materialize(
        [job.source, job.asset],
        instance=instance,
        resources=job.resources(),
        partition_key=None if shards == "range" else KEYS[1],
        tags={
            "dagster/asset_partition_range_start": KEYS[0],
            "dagster/asset_partition_range_end": KEYS[-1],
        }
        if shards == "range"
        else None,
        raise_on_error=False,
    )
    assert not failed.success
    for _ in range(500):  # a busy instance: failures of another job since
        instance.report_run_failed(instance.create_run_for_job(other_job))

    requests, _ = ticker.tick()

    assert sorted(r.partition_key or "" for r in requests) == covered
    assert {r.tags[RETRY_OF_TAG] for r in requests} == {failed.run_id}


@pytest.mark.parametrize("storage", ["local"], indirect=True)
def test_an_unpartitioned_asset_is_retried_as_a_whole(
    storage: Storage, instance: dg.DagsterInstance
) -> None:
    poison = {3}
    job = build_job(storage, tickets(20), fn=poisoned(poison), instance=instance)
    assert not job.materialize(raise_on_error=False).success
    ticker = Ticker(job, failed_partitions_sensor(job.asset, max_retries=1, backoff_seconds=0))

    requests, _ = ticker.tick()
    assert [r.partition_key for r in requests] == [None]
    assert not ticker.launch(requests[0]).success
    requests, skip = ticker.tick()
    assert requests == [] and "Gave up on 1 partition(s)" in skip and "(unpartitioned)" in skip

    poison.clear()
    assert job.materialize().success
    requests, skip = ticker.tick()
    assert requests == [] and skip.startswith("No failed partitions")


# -- the real daemon ---------------------------------------------------------------------------
@pytest.mark.slow
def test_the_daemon_launches_the_retries_then_stops(tmp_path: Path) -> None:
    """dagster-daemon evaluates the sensor and launches retry runs of a failed shard."""
    from helpers import sensor_defs

    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(
        textwrap.dedent(
            f"""\
            load_from:
              - python_module:
                  module_name: helpers.sensor_defs
                  working_directory: {REPO / "tests"}
            """
        )
    )
    env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(REPO / "tests")}
    resources = {"io_manager": CheckpointIOManager(base_dir=str(home / "checkpoints"))}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert dg.materialize([sensor_defs.tickets], instance=instance, resources=resources).success
        failed = dg.materialize(
            [sensor_defs.tickets, sensor_defs.scored],
            selection=[sensor_defs.scored],
            partition_key=sensor_defs.FAILING,
            instance=instance,
            resources=resources,
            raise_on_error=False,
        )
        assert not failed.success

        daemon = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", str(workspace)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            retries, skip = _wait_for_give_up(instance, deadline=time.monotonic() + 150)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGKILL)  # the daemon, its code server, its runs
            daemon.wait(timeout=30)

    assert [r.tags[RETRY_ATTEMPT_TAG] for r in retries] == ["1", "2"]
    assert {r.tags["dagster/partition"] for r in retries} == {sensor_defs.FAILING}
    assert all(r.status == dg.DagsterRunStatus.FAILURE for r in retries)
    assert (
        f"Gave up on 1 partition(s) of scored after 2 retries each: {sensor_defs.FAILING}" in skip
    )


def _wait_for_give_up(
    instance: dg.DagsterInstance, deadline: float
) -> tuple[list[dg.DagsterRun], str]:
    """Poll until the sensor's tick says it gave up; returns the retry runs (oldest first). The
    daemon is another process with its own clock: its instance is all there is to watch."""
    while time.monotonic() < deadline:
        time.sleep(0.25)
        retries = sorted(
            (r for r in instance.get_runs() if RETRY_ATTEMPT_TAG in r.tags),
            key=lambda r: r.tags[RETRY_ATTEMPT_TAG],
        )
        if any(not r.is_finished for r in retries):
            continue
        for state in instance.all_instigator_state():
            ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=1)
            if ticks and "Gave up" in (ticks[0].skip_reason or ""):
                return retries, ticks[0].skip_reason or ""
    states = [json.dumps(s.instigator_name) for s in instance.all_instigator_state()]
    raise AssertionError(f"the daemon did not give up in time (sensors seen: {states})")


# -- scale -------------------------------------------------------------------------------------
class _Statements:
    """Counts the SQL statements every SQLAlchemy engine sends while active."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> _Statements:
        sqlalchemy.event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", self._seen)

    def _seen(self, *args: object) -> None:
        self.count += 1


def test_a_tick_costs_the_same_queries_for_2_or_25_failed_shards() -> None:
    """A tick reads the instance in a fixed number of queries, not one per failed shard: with a
    thousand shards and a bad deploy, one per shard made each tick take seconds."""
    shards = shard_partitions(40)
    keys = shards.get_partition_keys()
    failing: set[str] = set()

    @dg.asset(name="routed", partitions_def=shards, backfill_policy=dg.BackfillPolicy.single_run())
    def history(context) -> None:  # type: ignore[no-untyped-def]  # an annotation is a string here
        if failing & set(context.partition_keys):
            raise RuntimeError("the endpoint is down")

    @checkpointed_asset(source="tickets", id_column="ticket_id", partitions_def=shards)
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        return batch

    sensor = failed_partitions_sensor(routed, backoff_seconds=0)
    defs = dg.Definitions(assets=[dg.AssetSpec("tickets"), routed], sensors=[sensor])
    range_tags = {
        "dagster/asset_partition_range_start": "",
        "dagster/asset_partition_range_end": "",
    }

    def ranged(first: str, last: str) -> bool:
        tags = dict(zip(range_tags, (first, last), strict=True))
        return dg.materialize([history], instance=instance, tags=tags, raise_on_error=False).success

    def single(key: str) -> bool:
        return dg.materialize(
            [history], instance=instance, partition_key=key, raise_on_error=False
        ).success

    def tick() -> tuple[set[str], int]:
        """A first tick (empty cursor) and the statements of the one after it."""
        context = dg.build_sensor_context(instance=instance, definitions=defs)
        first = sensor.evaluate_tick(context)
        context = dg.build_sensor_context(instance=instance, cursor=first.cursor, definitions=defs)
        with _Statements() as statements:
            sensor.evaluate_tick(context)
        return {r.partition_key or "" for r in first.run_requests or []}, statements.count

    with dg.instance_for_test() as instance:
        assert ranged(keys[0], keys[-1])
        failing.update([keys[1], *keys[10:12]])
        assert not single(keys[1])
        assert not ranged(keys[10], keys[11])
        few, few_statements = tick()

        failing.update([keys[2], keys[3], *keys[20:42]])
        assert not single(keys[2]) and not single(keys[3])
        assert not ranged(keys[20], keys[-1])
        many, many_statements = tick()

    assert few == {keys[1], keys[10], keys[11]}
    assert many == failing and len(many) == 25
    assert many_statements <= few_statements + 2, (few_statements, many_statements)
