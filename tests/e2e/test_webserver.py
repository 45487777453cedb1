"""The UI path: `dagster dev` (webserver + daemon) serves the demo, and a partition backfill
launched the way the UI launches it (the GraphQL mutation `launchPartitionBackfill`) runs every
shard to success, writing one checkpoint per shard."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from deploy_services import dagster_dev as run_dagster_dev
from helpers.graphql import launch_backfill

ROOT = Path(__file__).resolve().parents[2]
MODULE = "examples.ticket_routing.definitions"


@pytest.fixture
def dagster_dev(tmp_path: Path, demo_env: dict[str, str]) -> Iterator[tuple[int, dict[str, str]]]:
    env = {**demo_env, "DEMO_TICKETS": "1600"}
    with run_dagster_dev(env, tmp_path / "dagster_dev.log") as port:
        yield port, env


@pytest.mark.slow
def test_ui_backfill_of_every_shard_succeeds_and_writes_their_checkpoints(
    dagster_dev: tuple[int, dict[str, str]], tmp_path: Path
) -> None:
    port, env = dagster_dev
    materialized = subprocess.run(
        [
            sys.executable,
            "-m",
            "dagster",
            "asset",
            "materialize",
            "-m",
            MODULE,
            "--select",
            "tickets",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert materialized.returncode == 0, materialized.stderr[-3000:]
    keys = [f"{i}-of-8" for i in range(8)]

    backfill_id = launch_backfill(port, keys, "ticket_routing")

    os.environ["DAGSTER_HOME"], previous = env["DAGSTER_HOME"], os.environ.get("DAGSTER_HOME")
    try:
        instance = dg.DagsterInstance.get()
        deadline = time.monotonic() + 400
        while True:
            runs = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
            if len(runs) == len(keys) and all(r.is_finished for r in runs):
                break
            assert time.monotonic() < deadline, [r.status for r in runs]
            time.sleep(2)
    finally:
        if previous is None:
            os.environ.pop("DAGSTER_HOME")
        else:
            os.environ["DAGSTER_HOME"] = previous

    assert {r.status for r in runs} == {dg.DagsterRunStatus.SUCCESS}
    assert sorted(r.tags["dagster/partition"] for r in runs) == keys
    folder = tmp_path / "checkpoints" / "ticket_routing" / "default"
    assert sorted(p.name for p in folder.glob("*.parquet")) == [f"{k}.parquet" for k in keys]
