"""`dagster asset materialize -m ...` without DAGSTER_HOME runs on a temporary instance that the
command deletes when it exits: checkpoints stored under it would vanish. It must refuse. That it
works once DAGSTER_HOME names a lasting folder is ``e2e/test_dagster_cli.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "examples.ticket_routing.definitions"


@pytest.mark.slow
def test_dagster_asset_materialize_without_dagster_home_refuses(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "CHECKPOINT_BASE_DIR")}
    env.update(PYTHONPATH=str(ROOT), DEMO_TICKETS="400", DEMO_LATENCY_MS="0", DEMO_ERROR_RATE="0")
    project = tmp_path / "project"  # the command makes its temporary home here
    project.mkdir()

    refused = subprocess.run(
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
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )

    assert refused.returncode != 0
    output = refused.stdout + refused.stderr
    assert "CheckpointIOManager has no base_dir" in output
    assert ".tmp_dagster_home_" in output and "would be deleted after the run" in output
    assert "Set DAGSTER_HOME to an existing folder" in output
    assert list(project.iterdir()) == []  # nothing left behind, nothing written elsewhere
