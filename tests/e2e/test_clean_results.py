"""`checkpoint-assets clean --results`, run as users run it (its console script, in a
subprocess), on a result store written by real runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import polars as pl
from helpers.rows import engine_settings

from checkpoint_assets.engine import Checkpoint, open_store, prepare, run
from checkpoint_assets.engine.loop.shard_run import RunContext
from checkpoint_assets.engine.reuse import layout
from checkpoint_assets.engine.reuse.store import ResultStore

CLI = str(Path(sys.executable).parent / "checkpoint-assets")
DAY = 86_400


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120
    )


def _stored(base: Path, start: int, n: int) -> None:
    """A run whose ``n`` results go into the result store beside its checkpoint."""
    store = open_store(str(base))
    settings = engine_settings()
    rows = pl.DataFrame({"ticket_id": range(start, start + n), "body": [f"b{i}" for i in range(n)]})
    context = RunContext(
        results=ResultStore(store, store.path(layout.FOLDER)), function_fingerprint={"code": "x"}
    )
    inputs = prepare(rows.with_columns(pl.col("body") + f"-{start}"), settings, content=True)
    route = lambda b: b.select("ticket_id", route=pl.col("body").str.to_uppercase())  # noqa: E731
    run(route, inputs, Checkpoint(store, f"job/{start}"), settings, job={}, context=context)


def _age(files: list[Any], days: int) -> None:
    """Make ``files`` look written ``days`` ago: renamed with that time."""
    for f in files:
        old = layout.new_file("/", "s", 0, time.time() - days * DAY)
        os.rename(f.path, os.path.join(os.path.dirname(f.path), os.path.basename(old)))


def test_clean_results_deletes_old_results_and_keeps_the_rest(tmp_path: Path) -> None:
    base = tmp_path / "checkpoints"
    _stored(base, 0, 50)
    results = ResultStore(open_store(str(base / layout.FOLDER)))
    _age(results.files(), days=40)
    _stored(base, 100, 50)
    before = results.files()
    recent = [f for f in before if (layout.written_at(f.path) or 0) > time.time() - DAY]

    refused = cli("clean", str(base), "--results", "--older-than", "30d")
    done = cli("clean", str(base), "--results", "--older-than", "30d", "--yes")

    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert done.returncode == 0, done.stderr
    assert f"Deleted {len(before) - len(recent)} result file(s)" in done.stdout
    assert sorted(f.path for f in results.files()) == sorted(f.path for f in recent)
    assert Checkpoint(open_store(str(base)), "job/0").load("ticket_id").rows.height == 50


def test_clean_results_by_size_keeps_the_newest_within_the_bound(tmp_path: Path) -> None:
    base = tmp_path / "checkpoints"
    _stored(base, 0, 50)
    results = ResultStore(open_store(str(base / layout.FOLDER)))
    _age(results.files(), days=2)
    _stored(base, 100, 50)
    newest = [f for f in results.files() if (layout.written_at(f.path) or 0) > time.time() - DAY]
    bound = sum(f.size for f in newest)

    done = cli("clean", str(base), "--results", "--max-bytes", str(bound), "--yes")

    assert done.returncode == 0, done.stderr
    assert sorted(f.path for f in results.files()) == sorted(f.path for f in newest)


def test_clean_says_what_to_give(tmp_path: Path) -> None:
    neither = cli("clean", str(tmp_path))
    wrong = cli("clean", str(tmp_path), "--results", "--older-than", "soon")

    assert neither.returncode == 2 and "--results" in neither.stderr
    assert wrong.returncode == 2 and "30d" in wrong.stderr
