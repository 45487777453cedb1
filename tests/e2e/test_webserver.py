"""The UI path: `dagster dev` (webserver + daemon) serves the demo, and a partition backfill
launched the way the UI launches it (the GraphQL mutation `launchPartitionBackfill`) runs every
shard to success, writing one checkpoint per shard."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "examples.ticket_routing.definitions"
LAUNCH = """
mutation($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message }
  }
}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _graphql(port: int, query: str, variables: dict[str, Any] | None = None) -> Any:
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
def dagster_dev(tmp_path: Path, demo_env: dict[str, str]) -> Iterator[tuple[int, dict[str, str]]]:
    env = {**demo_env, "DEMO_TICKETS": "1600"}
    port = _free_port()
    log = open(tmp_path / "dagster_dev.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dagster",
            "dev",
            "-w",
            "workspace.yaml",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail((tmp_path / "dagster_dev.log").read_text()[-3000:])
                time.sleep(1)
        yield port, env
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


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

    answer = _graphql(
        port,
        LAUNCH,
        {"params": {"partitionNames": keys, "assetSelection": [{"path": ["ticket_routing"]}]}},
    )
    launched = answer["data"]["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched

    os.environ["DAGSTER_HOME"], previous = env["DAGSTER_HOME"], os.environ.get("DAGSTER_HOME")
    try:
        instance = dg.DagsterInstance.get()
        deadline = time.monotonic() + 400
        while True:
            runs = instance.get_runs(
                dg.RunsFilter(tags={"dagster/backfill": launched["backfillId"]})
            )
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
