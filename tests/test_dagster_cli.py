"""The paths CI users take: `dagster asset materialize -m <module>` from the repository root,
and the `checkpoint-assets` operator CLI on what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from checkpoint_assets.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]


def dagster(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dagster", *args, "-m", "examples.ticket_routing.definitions"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_dagster_asset_materialize_runs_a_shard_from_the_repo_root(
    demo_env: dict[str, str], tmp_path: Path
) -> None:
    assert dagster(demo_env, "asset", "materialize", "--select", "tickets").returncode == 0
    config = json.dumps({"ops": {"ticket_routing": {"config": {"checkpoint_interval": 50}}}})
    first = dagster(
        demo_env,
        "asset",
        "materialize",
        "--select",
        "ticket_routing",
        "--partition",
        "3-of-8",
        "--config-json",
        config,
    )
    assert first.returncode == 0, first.stderr[-3000:]

    checkpoint = tmp_path / "checkpoints" / "ticket_routing" / "default" / "3-of-8.parquet"
    stored = pl.read_parquet(checkpoint)
    tickets = pl.read_parquet(tmp_path / "checkpoints" / "tickets.parquet")
    assert 150 < stored.height < 350  # about 2,000 / 8
    assert stored["_error"].null_count() == stored.height
    assert set(stored["ticket_id"]) <= set(tickets["ticket_id"])

    again = dagster(
        demo_env, "asset", "materialize", "--select", "ticket_routing", "--partition", "3-of-8"
    )
    assert again.returncode == 0
    assert "rows are done, 0 to compute" in again.stderr + again.stdout


def test_operator_cli_lists_inspects_verifies_and_compacts(
    demo_env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dagster(demo_env, "asset", "materialize", "--select", "tickets").returncode == 0
    for key in ("0-of-8", "1-of-8"):
        done = dagster(
            demo_env, "asset", "materialize", "--select", "ticket_routing", "--partition", key
        )
        assert done.returncode == 0, done.stderr[-3000:]
    base = str(tmp_path / "checkpoints")

    assert cli(["status", base]) == 0
    listed = capsys.readouterr().out
    assert "ticket_routing" in listed and "0-of-8" in listed and "1-of-8" in listed

    assert cli(["inspect", base, "ticket_routing/default/0-of-8"]) == 0
    shown = capsys.readouterr().out
    assert "router-v1" in shown and "department" in shown

    assert cli(["verify", base]) == 0
    capsys.readouterr()

    part_dir = tmp_path / "checkpoints" / "ticket_routing" / "default" / "1-of-8.parquet.parts"
    part_dir.mkdir(exist_ok=True)
    (part_dir / "part-000000009999-000000009999-0123456789ab.parquet").write_bytes(b"not parquet")
    assert cli(["verify", base]) == 1
    assert "unreadable" in capsys.readouterr().out
    assert (part_dir / "part-000000009999-000000009999-0123456789ab.parquet").exists()

    (part_dir / "part-000000009999-000000009999-0123456789ab.parquet").unlink()
    assert cli(["compact", base, "ticket_routing/default/0-of-8"]) == 0
    assert cli(["inspect", base, "does/not/exist"]) == 2
    assert "No checkpoint" in capsys.readouterr().err
