"""The path CI users take: `dagster asset materialize -m <module>` from the repository root, on
the instance of ``$DAGSTER_HOME``, whose ``checkpoints`` folder then holds the checkpoints.

Without DAGSTER_HOME the command refuses: ``e2e/test_home.py``. The `checkpoint-assets`
operator CLI is tested in ``e2e/test_cli.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[2]


def dagster(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dagster", *args, "-m", "examples.ticket_routing.definitions"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_dagster_asset_materialize_runs_a_shard_from_the_repo_root_into_dagster_home(
    demo_env: dict[str, str],
) -> None:
    env = {k: v for k, v in demo_env.items() if k != "CHECKPOINT_BASE_DIR"}
    checkpoints = Path(env["DAGSTER_HOME"]) / "checkpoints"  # no base_dir: DAGSTER_HOME's
    config = json.dumps({"ops": {"ticket_routing": {"config": {"checkpoint_interval": 50}}}})
    # The source and a shard in one run (the source is not partitioned: it ignores the key).
    first = dagster(
        env,
        "asset",
        "materialize",
        "--select",
        "tickets,ticket_routing",
        "--partition",
        "3-of-8",
        "--config-json",
        config,
    )
    assert first.returncode == 0, first.stderr[-3000:]

    stored = pl.read_parquet(checkpoints / "ticket_routing" / "default" / "3-of-8.parquet")
    tickets = pl.read_parquet(checkpoints / "tickets.parquet")
    assert 150 < stored.height < 350  # about 2,000 / 8
    assert stored["_error"].null_count() == stored.height
    assert set(stored["ticket_id"]) <= set(tickets["ticket_id"])

    again = dagster(
        env, "asset", "materialize", "--select", "ticket_routing", "--partition", "3-of-8"
    )
    assert again.returncode == 0
    assert "rows are done, 0 to compute" in again.stderr + again.stdout
