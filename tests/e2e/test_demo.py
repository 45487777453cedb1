"""The demo (``scripts/demo`` runs ``examples.ticket_routing.demo``): one asset backfill of all
shards, launched by Dagster's daemon as one run; run again, it computes nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _demo(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "examples.ticket_routing.demo", "--timeout", "500"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def _counts(output: str) -> tuple[int, int, int]:
    """Runs, tickets computed and tickets resumed, from the demo's closing line."""
    line = re.search(
        r"(\d+) run\(s\) \(0 failed\), 8 of 8 shards materialized, in [\d.]+ s: "
        r"([\d,]+) tickets, ([\d,]+) computed now, ([\d,]+) resumed",
        output,
    )
    assert line, output[-3000:]
    runs, total, computed, resumed = (int(g.replace(",", "")) for g in line.groups())
    assert total == 2000
    return runs, computed, resumed


@pytest.mark.timeout(1300)
def test_the_demo_backfills_all_shards_in_one_run_and_computes_nothing_the_second_time(
    demo_env: dict[str, str],
) -> None:
    first = _demo(demo_env)
    second = _demo(demo_env)

    assert _counts(first) == (1, 2000, 0)
    assert _counts(second) == (1, 0, 2000)
    assert "tickets: 2,000 stored, kept" in second
    with dg.DagsterInstance.from_config(demo_env["DAGSTER_HOME"]) as instance:
        runs = [r for r in instance.get_runs() if "dagster/backfill" in r.tags]
        backfills = {r.tags["dagster/backfill"] for r in runs}
        # Two backfills (one per demo run), each one run over the range of all 8 shards.
        assert len(runs) == len(backfills) == 2
        for run in runs:
            assert run.status == dg.DagsterRunStatus.SUCCESS
            assert run.tags["dagster/asset_partition_range_start"] == "0-of-8"
            assert run.tags["dagster/asset_partition_range_end"] == "7-of-8"
            assert instance.get_backfill(run.tags["dagster/backfill"]) is not None
