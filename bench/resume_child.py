"""One resume of a finished checkpoint, in its own process: time by phase and peak memory.

Run by ``bench/run.py`` as ``python -m bench.resume_child INPUT BASE_DIR NAME``; prints one JSON
object. The input is read from the Parquet file the parent wrote, as Dagster's IO manager would
load the upstream asset; that read is reported apart, it is not the engine's time.

First the real resume (``prepare`` + ``run``) is timed end to end and the process's peak RSS
(input included) is read right after it. Then the same steps are timed one by one with the
engine's own functions, for the breakdown: listing (meta and parts), reading (merged file and
parts, resolved), fingerprint (id validation and per-row input hashes), filtering (which rows are
left to do). ``other`` is the rest of the real run: the lock, finalize and building the result.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

import polars as pl

from bench import data
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.loop import runner
from checkpoint_assets.engine.plan.resume import plan
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.storage import open_store


def main(input_path: str, base_dir: str, name: str) -> dict[str, Any]:
    started = time.perf_counter()
    frame = pl.read_parquet(input_path)
    input_seconds = time.perf_counter() - started
    rows = frame.height
    config = data.settings(interval=max(rows, 1))
    store = open_store(base_dir)

    started = time.perf_counter()
    inputs = runner.prepare(frame, config)
    result, stats = runner.run(data.score, inputs, Checkpoint(store, name), config, job=data.JOB)
    total = time.perf_counter() - started
    peak_rss = _peak_rss()
    if stats.rows_computed or stats.rows_resumed != rows or result.height != rows:
        raise SystemExit(
            f"expected a no-op resume of {rows} rows, got {stats.rows_computed} computed, "
            f"{stats.rows_resumed} resumed, {result.height} in the result"
        )
    del result, inputs

    phases: dict[str, float] = {}
    checkpoint = Checkpoint(store, name)
    t = time.perf_counter()
    meta = checkpoint.meta_file.read()
    checkpoint.list_parts()
    phases["listing"] = time.perf_counter() - t
    t = time.perf_counter()
    stored = checkpoint.load(data.ID, meta.base_seq if meta else 0)
    phases["reading"] = time.perf_counter() - t
    t = time.perf_counter()
    inputs = runner.prepare(frame, config)
    hashing.fingerprint(inputs.get_column("_input_hash").to_numpy())
    phases["fingerprint"] = time.perf_counter() - t
    t = time.perf_counter()
    plan(
        inputs,
        stored.rows,
        data.ID,
        resume=True,
        retry_failed=config.retry_failed,
        on_input_change=config.on_input_change,
    )
    phases["filtering"] = time.perf_counter() - t
    phases["other"] = max(total - sum(phases.values()), 0.0)
    return {
        "rows": rows,
        "seconds": total,
        "input_read_seconds": input_seconds,
        "phases": phases,
        "peak_rss_bytes": peak_rss,
        "requests": dict(stats.requests),
    }


def _peak_rss() -> int:
    """This process's peak resident memory, in bytes.

    Linux's ``VmHWM`` belongs to the process image: ``ru_maxrss`` would also count the parent's
    memory at the fork that preceded this process's exec.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3])))
