"""Resharding with ``global_resume: true``: what each new shard reads, by both paths, side by side.

- ``reshard``: finished checkpoints of ``old`` range shards, then what a shard of the ``new``
  count reads before its first call: the overlapping checkpoints of the old count (``ranges``),
  against the global resume table read whole (``table``, the path every shard took before, and
  still the one for unpartitioned or mod-rule checkpoints). Requests, bytes and rows read, time
  and peak memory per shard, each path in its own process; totals for all new shards are the
  per-shard means times the new count (a sample of shards is read when there are many).
- ``global_table``: the ``<asset>_global_resume`` asset over many stored rows across 256
  checkpoints (time, peak memory), against the reconcile it replaced (one sort of the whole
  table), at each size given, so growth faster than linear shows as a ratio.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

from bench import data
from bench.report import Result
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.loop import runner
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.scheme import Scheme, Shard
from checkpoint_assets.engine.storage import open_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1024**2
PAIRS = ((64, 48), (8, 1000))
SAMPLE = 50  # new shards read per path (evenly spread) when the new count is larger
# The sorted reconcile needs about 190 bytes a row (19 GiB at 10**8 rows): not run above this.
BASELINE_MAX_ROWS = 30_000_000


def build(base_dir: str, folder: str, rows: int, count: int) -> None:
    """Finished checkpoints of ``count`` range shards over ``rows`` rows, through the engine."""
    frame = data.make_input(rows)
    of = hashing.shard_of(frame.get_column(data.ID), count)
    order = np.argsort(of, kind="stable")
    bounds = np.searchsorted(of[order], np.arange(count + 1))
    store = open_store(base_dir)
    for index in range(count):
        mine = frame[order[bounds[index] : bounds[index + 1]]]
        key = Shard(index, count).key
        config = data.settings(interval=max(mine.height, 1))
        checkpoint = Checkpoint(store, f"{folder}/{key}")
        scheme = Scheme.of(key)
        runner.run(
            data.score,
            runner.prepare(mine, config),
            checkpoint,
            config,
            job=data.JOB,
            scheme=scheme,
        )


def reshard(rows: int, sample: int, workdir: str) -> Result:
    result = Result("reshard", f"global resume per new shard, {rows:,} rows: ranges vs table")
    for old, new in PAIRS:
        base_dir = os.path.join(workdir, f"reshard-{old}-{new}")
        folder = "bench/default"
        build(base_dir, folder, rows, old)
        built = _child("table", base_dir, folder, "current")  # the table path's one-time cost
        picked = sorted({int(i) for i in np.linspace(0, new - 1, min(new, sample))})
        which = ",".join(map(str, picked))
        side: dict[str, dict[str, Any]] = {}
        for path in ("ranges", "table"):
            side[path] = _child("shards", base_dir, folder, path, str(new), which)
        label = f"{old}->{new}"
        for path, got in side.items():
            n = got["shards"]
            requests = sum(got["requests"].values()) / n
            result.add(f"{label} {path}: requests per shard", requests)
            result.add(f"{label} {path}: MiB read per shard", got["bytes_read"] / n / MIB, "MiB")
            result.add(f"{label} {path}: rows read per shard", got["rows_read"] / n)
            result.add(f"{label} {path}: seconds per shard", got["seconds"] / n, "s")
            result.add(f"{label} {path}: peak RSS of a shard", got["peak_rss_bytes"] / MIB, "MiB")
            total = requests * new + (sum(built["requests"].values()) if path == "table" else 0)
            result.add(f"{label} {path}: requests, all {new} shards", total)
        ranges, table = side["ranges"], side["table"]
        result.add(
            f"{label} ranges/table: bytes read",
            ranges["bytes_read"] / max(table["bytes_read"], 1),
            "x",
        )
        result.add(
            f"{label} ranges/table: peak RSS",
            ranges["peak_rss_bytes"] / max(table["peak_rss_bytes"], 1),
            "x",
        )
        result.details[label] = {"table_build": built, "shards": picked, **side}
    return result


def global_table(sizes: tuple[int, ...], checkpoints: int, workdir: str) -> Result:
    result = Result("global_table", f"global resume asset over {checkpoints} checkpoints")
    per_row: dict[int, float] = {}
    for rows in sizes:
        base_dir = os.path.join(workdir, f"global-{rows}")
        folder = "bench/default"
        _child("build", base_dir, folder, str(rows), str(checkpoints))  # its memory is freed
        current = _child("table", base_dir, folder, "current")
        assert current["rows"] == rows
        result.add(f"{rows:,} rows: seconds", current["seconds"], "s")
        result.add(f"{rows:,} rows: peak RSS", current["peak_rss_bytes"] / MIB, "MiB")
        before: dict[str, Any] = {}
        if rows <= BASELINE_MAX_ROWS:
            before = _child("table", base_dir, folder, "sorted")
            assert before["rows"] == rows
            result.add(f"{rows:,} rows: seconds, sorted (before)", before["seconds"], "s")
            result.add(
                f"{rows:,} rows: peak RSS, sorted (before)", before["peak_rss_bytes"] / MIB, "MiB"
            )
        result.add(f"{rows:,} rows: requests", sum(current["requests"].values()))
        per_row[rows] = current["seconds"] / rows
        result.details[str(rows)] = {"current": current, "sorted": before}
        _remove(base_dir)
    if len(per_row) >= 2:
        small, large = min(per_row), max(per_row)
        result.add(f"seconds per row, {large:,} / {small:,}", per_row[large] / per_row[small], "x")
    return result


def _child(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.reshard_child", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"reshard_child {args[0]} failed:\n{done.stderr[-4000:]}")
    payload: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return payload


def _remove(folder: str) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
