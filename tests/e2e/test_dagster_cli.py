"""The paths CI users take: `dagster asset materialize -m <module>` from the repository root,
and the `checkpoint-assets` operator CLI on what it wrote."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from helpers.jobs import parts_by_partition

from checkpoint_assets.cli import main as cli
from checkpoint_assets.engine.checkpoint import Checkpoint
from checkpoint_assets.engine.rows import SEQ
from checkpoint_assets.engine.storage import open_store

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
    # An unmerged part, as a run interrupted after a flush leaves one: compact merges it.
    checkpoint = Checkpoint(open_store(base), "ticket_routing/default/1-of-8")
    merged, watermark = checkpoint.read_merged()
    assert merged is not None
    newer = merged.head(3).with_columns(pl.lit(watermark + 1, pl.Int64).alias(SEQ))
    checkpoint.write_part(newer, watermark + 1)
    assert cli(["status", base]) == 0
    assert parts_by_partition(capsys.readouterr().out) == {"0-of-8": "0", "1-of-8": "1"}

    _write_live_lock(checkpoint)
    assert cli(["compact", base]) == 1  # the locked checkpoint is skipped, and said so
    assert "1-of-8: skipped" in capsys.readouterr().err
    assert len(checkpoint.list_parts()[0]) == 1
    checkpoint.store.delete([checkpoint.files.lock])

    assert cli(["compact", base]) == 0
    assert "1-of-8: merged 1 part(s)" in capsys.readouterr().err
    assert checkpoint.list_parts()[0] == []
    merged_again, watermark_again = checkpoint.read_merged()
    assert merged_again is not None and watermark_again == watermark + 1
    assert merged_again.height == merged.height
    assert cli(["verify", base]) == 0

    assert cli(["inspect", base, "does/not/exist"]) == 2
    assert "checkpoint-assets status" in capsys.readouterr().err


def _write_live_lock(checkpoint: Checkpoint) -> None:
    now = time.time()
    holder = {"token": "t", "run_id": None, "host": socket.gethostname(), "pid": os.getpid()}
    holder |= {"since": now, "expires": now + 3600}
    checkpoint.store.put(checkpoint.files.lock, json.dumps(holder).encode())
