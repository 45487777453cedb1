"""`dagster asset materialize -m ...` without DAGSTER_HOME runs on a temporary instance that the
command deletes when it exits: checkpoints stored under it would vanish. It must refuse, and
work once DAGSTER_HOME names a lasting folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "examples.ticket_routing.definitions"


def materialize(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dagster", "asset", "materialize", "-m", MODULE, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_dagster_asset_materialize_without_dagster_home_refuses_then_works_with_it(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "CHECKPOINT_BASE_DIR")}
    env.update(PYTHONPATH=str(ROOT), DEMO_TICKETS="400", DEMO_LATENCY_MS="0", DEMO_ERROR_RATE="0")
    project = tmp_path / "project"  # the command makes its temporary home here
    project.mkdir()

    refused = materialize(project, env, "--select", "tickets")

    assert refused.returncode != 0
    output = refused.stdout + refused.stderr
    assert "CheckpointIOManager has no base_dir" in output
    assert ".tmp_dagster_home_" in output and "would be deleted after the run" in output
    assert "Set DAGSTER_HOME to an existing folder" in output
    assert list(project.iterdir()) == []  # nothing left behind, nothing written elsewhere

    home = tmp_path / "dagster_home"
    home.mkdir()
    env["DAGSTER_HOME"] = str(home)
    assert materialize(project, env, "--select", "tickets").returncode == 0
    first = materialize(project, env, "--select", "ticket_routing", "--partition", "1-of-8")
    assert first.returncode == 0, first.stderr[-3000:]

    stored = pl.read_parquet(home / "checkpoints" / "ticket_routing" / "default" / "1-of-8.parquet")
    assert 20 < stored.height < 80  # about 400 / 8
    assert (home / "checkpoints" / "tickets.parquet").exists()
