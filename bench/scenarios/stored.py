"""3, 4 and 6. What is stored: resume of a finished checkpoint (time, memory), and compaction."""

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import polars as pl

from bench import data
from bench.report import Result
from bench.scenarios.common import Sizes, child, timed
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.compaction import Part
from checkpoint_assets.engine.loop import runner
from checkpoint_assets.engine.rows import CURRENT, SEQ
from checkpoint_assets.engine.storage import open_store

GIB = 1024**3


# -- 3 and 6. resume of a finished checkpoint, and its memory -------------------------------
def resume(sizes: Sizes, workdir: str) -> tuple[Result, Result]:
    """No-op resumes of finished checkpoints, each in a fresh process: time, phases, memory."""
    timing = Result("resume", "resume of a finished checkpoint (engine time)")
    memory = Result("memory", "peak RSS of the resume process")
    base_dir = os.path.join(workdir, "resume")
    seconds: dict[int, float] = {}
    for rows in sizes.resume_rows:
        name = f"finished-{rows}"
        source = os.path.join(workdir, "resume-inputs", f"{rows}.parquet")
        os.makedirs(os.path.dirname(source), exist_ok=True)
        frame = data.make_input(rows)
        frame.write_parquet(source)
        started = time.perf_counter()
        data.build_finished(base_dir, name, frame, _build_interval(rows))
        build = time.perf_counter() - started
        del frame
        runs = [child("bench.resume_child", source, base_dir, name) for _ in range(sizes.repeat)]
        median_run = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
        seconds[rows] = median_run["seconds"]
        limit = {1_000_000: 0.5, 10_000_000: 3.0}.get(rows)
        timing.add(f"{rows:,} rows", seconds[rows], "s", limit=limit)
        for phase, value in median_run["phases"].items():
            timing.add(f"{rows:,} rows: {phase}", value, "s")
        peak = max(r["peak_rss_bytes"] for r in runs) / GIB
        memory.add(f"{rows:,} rows", peak, "GiB", limit=1.5 if rows == 10_000_000 else None)
        timing.details[str(rows)] = {"build_seconds": build, "runs": runs}
    if len(seconds) >= 2:
        small, large = min(seconds), max(seconds)
        timing.add(
            f"cost({large:,})/cost({small:,})",
            seconds[large] / seconds[small],
            "x",
            limit=1.2 * large / small,
        )
    return timing, memory


def _build_interval(rows: int) -> int:
    return max(1, min(rows, 500_000))


# -- 4. compaction: many small flushes -----------------------------------------------------
class _MeasuredCheckpoint(Checkpoint):
    """A checkpoint that records its part count and times a cold resume and finalize."""

    max_parts = 0
    parts_at_end = 0
    read_seconds = math.nan
    finalize_seconds = math.nan

    def compact(self, parts: list[Part], id_column: str) -> list[Part]:
        live = super().compact(parts, id_column)
        self.max_parts = max(self.max_parts, len(live))
        return live

    def finalize(self, id_column: str, *args: Any, **kwargs: Any) -> pl.DataFrame:
        self.parts_at_end = len(self.list_parts()[0])
        self.read_seconds = timed(lambda: Checkpoint(self.store, self.name).load(id_column))
        started = time.perf_counter()
        rows = super().finalize(id_column, *args, **kwargs)
        self.finalize_seconds = time.perf_counter() - started
        return rows


def compaction(sizes: Sizes, workdir: str) -> Result:
    """Flush every few rows: parts stay bounded. Against the same run's parts never merged:
    one part per flush the engine made, the same rows, written by the engine's own part writer
    (pyarrow, lz4), so compaction is the only difference."""
    result = Result("compaction", "many small flushes: compacted parts vs the same never merged")
    frame = data.make_input(sizes.rows)
    config = data.settings(sizes.compaction_interval)
    store = open_store(os.path.join(workdir, "compaction"))
    checkpoint = _MeasuredCheckpoint(store, "compacted")
    started = time.perf_counter()
    result_rows, stats = runner.run(
        data.score, runner.prepare(frame, config), checkpoint, config, job=data.JOB
    )
    run_seconds = time.perf_counter() - started

    baseline = Checkpoint(store, "never-merged")
    parts = _write_parts_directly(baseline, checkpoint)
    baseline_read = timed(lambda: Checkpoint(store, baseline.name).load(data.ID))
    _remove_tree(baseline.files.parts)

    result.add("flushes", stats.flushes)
    result.add("max parts during the run", checkpoint.max_parts)
    result.add("unmerged parts at the end", checkpoint.parts_at_end, limit=64)
    result.add("finalize", checkpoint.finalize_seconds, "s", limit=2.0)
    result.add("resume read, compacted", checkpoint.read_seconds, "s")
    result.add("baseline parts (one per flush, never merged)", parts)
    result.add("resume read, baseline", baseline_read, "s")
    result.add("resume read ratio baseline/compacted", baseline_read / checkpoint.read_seconds, "x")
    result.add("storage requests", sum(stats.requests.values()))
    result.add("whole run", run_seconds, "s")
    result.details = {
        "rows": frame.height,
        "interval": sizes.compaction_interval,
        "result_rows": result_rows.height,
        "requests": stats.requests,
    }
    return result


def _write_parts_directly(target: Checkpoint, source: Checkpoint) -> int:
    """The baseline's layout: one part per flush of ``source`` (its rows, by their flush
    number), encoded as the engine encodes parts, never merged. Written without fsync (only the
    reading is timed)."""
    rows = source.read_merged()[0]
    assert rows is not None
    rows = rows.drop(CURRENT)
    flushes = rows.partition_by(SEQ, maintain_order=True)
    os.makedirs(target.files.parts, exist_ok=True)
    for part in flushes:
        seq = int(part.get_column(SEQ)[0])
        with open(target.files.new_part(seq, seq), "wb") as f:
            f.write(target.encode_part(part))
    return len(flushes)


def _remove_tree(folder: str) -> None:
    """Delete many files in parallel (unlinks are slow one by one on disks mounted -o discard)."""
    paths = [os.path.join(folder, n) for n in os.listdir(folder)] if os.path.isdir(folder) else []
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(os.remove, paths))
    if os.path.isdir(folder):
        os.rmdir(folder)
