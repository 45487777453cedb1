"""``checkpoint-assets estimate``, run as users run it.

Its console script runs in a subprocess and loads the definitions from a file (``-f``). It uses
the instance and checkpoints of ``$DAGSTER_HOME`` and the local chat server. It prints the
figures the dry run records and the real run meets. The table and the errors come from the same
command line run in this process (``main``, what the console script calls): its output and exit
status, without a process start each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from helpers import estimate_defs
from helpers.estimate_defs import ASSET, ROWS

from checkpoint_assets.cli import main
from checkpoint_assets.integration import metadata as md
from examples.llm_openai import server

CLI = str(Path(sys.executable).parent / "checkpoint-assets")
DEFS = str(Path(estimate_defs.__file__))
ROOT = Path(__file__).parents[2]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A fresh DAGSTER_HOME and the chat server, in this process's environment and the CLI's."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((ROOT / "dagster_home" / "dagster.yaml").read_text())
    with server.serve() as url:
        env = {"DAGSTER_HOME": str(home), "OPENAI_BASE_URL": url}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        yield env


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env={**os.environ},
        cwd=ROOT,
        timeout=300,
    )


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """The command line ``args`` run in this process by the console script's ``main``."""
    capsys.readouterr()  # what came before
    returncode = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["checkpoint-assets", *args], returncode, out, err)


def materialize(partition: str | None = None, **config: Any) -> dg.ExecuteInProcessResult:
    """Run the definitions' asset (or, without a partition, store the texts) in process."""
    defs = estimate_defs.defs
    selection = [ASSET] if partition else ["texts"]
    job = defs.resolve_implicit_global_asset_job_def()
    with dg.DagsterInstance.get() as instance:
        return job.execute_in_process(
            instance=instance,
            partition_key=partition,
            asset_selection=[dg.AssetKey(k) for k in selection],
            run_config={"ops": {ASSET: {"config": config}}} if partition else None,
        )


def files(home: dict[str, str]) -> dict[str, bytes]:
    root = Path(home["DAGSTER_HOME"]) / "checkpoints" / ASSET
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_the_cli_prints_the_dry_runs_figures_and_the_real_run_meets_them(
    home: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    materialize()  # the texts, stored under $DAGSTER_HOME
    materialize("0-of-2", limit=10)  # a partial run of one shard
    stored = files(home)
    asked = server.stats(home["OPENAI_BASE_URL"])["requests"]

    done = cli("estimate", "-f", DEFS, ASSET, "--json")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    shards = {s.pop("partition"): s for s in printed["shards"]}
    assert set(shards) == {"0-of-2", "1-of-2"}
    assert shards["0-of-2"]["rows_done"] == 10
    assert shards["1-of-2"]["rows_done"] == 0
    assert printed["total"]["rows_total"] == ROWS
    assert printed["total"]["rows_to_compute"] == ROWS - 10
    assert server.stats(home["OPENAI_BASE_URL"])["requests"] == asked  # nothing was asked
    assert files(home) == stored  # nothing was written

    # The same figures as the dry run recorded in the instance, and the real run's rows.
    with dg.DagsterInstance.get() as instance:
        records = instance.fetch_observations(dg.AssetKey(ASSET), limit=10).records
    observed = {
        r.partition_key: md.estimate_of(
            {k: md.plain(v) for k, v in r.asset_observation.metadata.items()}
        ).as_dict()
        for r in records
        if r.asset_observation is not None
    }
    assert observed == shards
    for partition, figures in shards.items():
        (event,) = materialize(partition).asset_materializations_for_node(ASSET)
        assert event.metadata["rows_computed"].value == figures["rows_to_compute"]

    # Once the shard is done, the table shows nothing left to compute.
    table = in_process(capsys, "estimate", "-f", DEFS, ASSET, "--partition", "1-of-2")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["partition", "rows", "done"]
    rows = f"{shards['1-of-2']['rows_total']:,}"
    assert lines[1].split()[:8] == ["1-of-2", rows, rows, "0", "0", "0", "0", "0"]
    assert lines[2].split()[:8] == ["total", rows, rows, "0", "0", "0", "0", "0"]
    assert "Input tokens counted by bytes/4." in table.stderr


def test_the_cli_names_what_is_wrong_and_exits_2(
    home: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    unknown = in_process(capsys, "estimate", "-f", DEFS, "texts")
    assert unknown.returncode == 2
    assert "texts is not a checkpointed asset" in unknown.stderr
    assert "Name one of: routed." in unknown.stderr
    missing = in_process(capsys, "estimate", "-f", DEFS, ASSET, "--partition", "7-of-2")
    assert missing.returncode == 2
    assert "no partition 7-of-2" in missing.stderr
    # The source was never materialized: the dry run fails as the run would, with its cause.
    failed = in_process(capsys, "estimate", "-f", DEFS, ASSET, "--partition", "0-of-2")
    assert failed.returncode == 2
    assert "The dry run of routed 0-of-2 failed:" in failed.stderr
