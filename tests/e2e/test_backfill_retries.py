"""Failed shards of ``dagster job backfill`` are retried by ``failed_partitions_sensor``.

``dagster job backfill`` marks its backfill COMPLETED as it submits the runs, and Dagster's run
retry daemon declines the runs of a backfill that has ended: without the sensor, a failed shard of
such a backfill stays failed. The real CLI submits the backfill to a real instance (SQLite, run
retries on, runs launched as processes); the sensor is evaluated against that instance.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dagster as dg
import pytest

from checkpoint_assets import CheckpointIOManager
from checkpoint_assets.integration.watch.sensor import RETRY_OF_TAG

REPO = Path(__file__).resolve().parents[2]
BACKFILL = (sys.executable, "-m", "dagster", "job", "backfill", "--noprompt")


@pytest.mark.slow
def test_a_failed_shard_of_a_job_backfill_is_retried_by_the_sensor(tmp_path: Path) -> None:
    from helpers import sensor_defs

    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        textwrap.dedent(
            """\
            telemetry:
              enabled: false
            run_retries:
              enabled: true
              max_retries: 2
            run_coordinator:
              module: dagster._core.run_coordinator
              class: DefaultRunCoordinator
            """
        )
    )
    env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(REPO / "tests")}
    resources = {"io_manager": CheckpointIOManager(base_dir=str(home / "checkpoints"))}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert dg.materialize([sensor_defs.tickets], instance=instance, resources=resources).success
        backfill = subprocess.run(
            [*BACKFILL, "-m", "helpers.sensor_defs", "-j", "scored_job", "--all", "all"],
            cwd=REPO / "tests",
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert backfill.returncode == 0, backfill.stderr[-3000:]
        runs = _finished_runs(instance, count=2, deadline=time.monotonic() + 240)
        failed = {r.tags["dagster/partition"]: r for r in runs if not r.is_success}
        assert list(failed) == [sensor_defs.FAILING]
        run = failed[sensor_defs.FAILING]
        # Dagster tags the run for a retry, then declines it: its backfill has ended.
        assert run.tags.get("dagster/will_retry") == "true"
        (record,) = instance.get_backfills()
        assert record.status.value == "COMPLETED"

        requests = _tick(instance)
        assert [r.partition_key for r in requests] == [sensor_defs.FAILING]
        assert requests[0].tags[RETRY_OF_TAG] == run.run_id

        # While its backfill is still running, the same run is left to Dagster's run retries.
        instance.update_backfill(record.with_status(type(record.status).REQUESTED))
        assert _tick(instance) == []


def _tick(instance: dg.DagsterInstance) -> list[dg.RunRequest]:
    from helpers import sensor_defs

    context = dg.build_sensor_context(instance=instance, definitions=sensor_defs.defs)
    return list(sensor_defs.retries.evaluate_tick(context).run_requests or [])


def _finished_runs(
    instance: dg.DagsterInstance, count: int, deadline: float
) -> list[dg.DagsterRun]:
    """The instance's runs once ``count`` of them exist and all have finished."""
    while time.monotonic() < deadline:
        runs = instance.get_runs()
        if len(runs) >= count + 1 and all(r.is_finished for r in runs):  # + the source's run
            return [r for r in runs if "dagster/backfill" in r.tags]
        time.sleep(0.5)
    states = [(r.job_name, r.status.value) for r in instance.get_runs()]
    raise AssertionError(f"the backfill's runs did not finish in time: {states}")
