"""The scenarios of issue 4, each measured against a baseline in the same run.

No ``from __future__ import annotations`` here: Dagster reads the assets' annotations at runtime.
"""

import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import dagster as dg
import polars as pl
import pyarrow.parquet as pq

from bench import data
from bench.report import Result
from checkpoint_assets import CheckpointIOManager, checkpointed_asset
from checkpoint_assets.engine import hashing, runner
from checkpoint_assets.engine.checkpoint import Checkpoint
from checkpoint_assets.engine.compaction import Part
from checkpoint_assets.engine.layout import checkpoint_name
from checkpoint_assets.engine.rows import CURRENT, SEQ
from checkpoint_assets.engine.storage import open_store

GIB = 1024**3
# A minimum time between flushes short enough that the overhead job flushes several times
# (its calls take about a third of a second): the setting measured beside the 1 s one.
SHORT_FLOOR = 0.05
CHECKPOINTED = "bench_checkpointed"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Sizes:
    """Every size the scenarios use (``--smoke`` makes them tiny)."""

    rows: int
    interval: int
    per_call_rows: int
    per_call_interval: int
    per_call_sleep: float
    resume_rows: tuple[int, ...]
    compaction_interval: int
    hash_rows: int
    repeat: int
    remote_rows: int = 3200
    reshard_rows: int = 1_000_000
    reshard_sample: int = 50
    global_rows: tuple[int, ...] = (10_000_000, 30_000_000)
    global_checkpoints: int = 256
    overhead_rounds: int = 5  # at least; more with a larger ``repeat``
    overhead_warmup: int = 1  # rounds first, not counted (a smoke run's figures mean nothing: 0)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# -- 1. overhead through Dagster -----------------------------------------------------------
def overhead(sizes: Sizes, workdir: str) -> Result:
    """A checkpointed asset against a plain Dagster asset writing Parquet, same function."""
    result = Result("overhead", "checkpointed asset vs plain Dagster asset (materialize)")
    frame = data.make_input(sizes.rows)

    @dg.asset(name="bench_input")
    def bench_input() -> pl.DataFrame:
        return frame

    @checkpointed_asset(
        source="bench_input",
        id_column=data.ID,
        input_columns=[data.TEXT],
        checkpoint_interval=sizes.interval,
        name=CHECKPOINTED,
    )
    def bench_checkpointed(batch: pl.DataFrame) -> pl.DataFrame:
        return data.score(batch)

    # The same job trading the loss bound in rows for one in time: flushes at most once per
    # ``floor`` seconds. A floor longer than the run never flushes before the end (the clock
    # starts when the run starts): the whole run is one write, so each is reported with the
    # flushes it made.
    def timed(name: str, floor: float) -> dg.AssetsDefinition:
        @checkpointed_asset(
            source="bench_input",
            id_column=data.ID,
            input_columns=[data.TEXT],
            checkpoint_interval=sizes.interval,
            min_flush_seconds=floor,
            name=name,
        )
        def bench_timed(batch: pl.DataFrame) -> pl.DataFrame:
            return data.score(batch)

        return bench_timed

    bench_timed = timed("bench_timed", 1.0)
    bench_timed_short = timed("bench_timed_short", SHORT_FLOOR)

    @dg.asset(name="bench_plain", ins={"source": dg.AssetIn("bench_input")})
    def bench_plain(source: pl.DataFrame) -> pl.DataFrame:
        return data.score(source)

    # The least any design that loses at most one interval must do: the plain asset, plus each
    # interval's results written durably (Parquet, fsync) by a background thread, one write in
    # flight. No ids, hashing, resume, lock, compaction or merge. A target below this floor's
    # ratio is out of reach of every design with that guarantee, on this machine.
    floor_dir = os.path.join(workdir, "overhead-floor")

    def interval_write(rows: pl.DataFrame, path: str, sync: bool) -> None:
        with open(path, "wb") as f:
            pq.write_table(rows.to_arrow(), f, compression="lz4", write_statistics=False)
            f.flush()
            if sync:
                os.fsync(f.fileno())

    def write_each_interval(source: pl.DataFrame, sync: bool) -> pl.DataFrame:
        os.makedirs(floor_dir, exist_ok=True)
        done: list[pl.DataFrame] = []
        with ThreadPoolExecutor(1) as writer:
            writing = None
            for start in range(0, source.height, sizes.interval):
                out = data.score(source.slice(start, sizes.interval))
                if writing is not None:
                    writing.result()
                path = os.path.join(floor_dir, f"{start}.parquet")
                writing = writer.submit(interval_write, out, path, sync)
                done.append(out)
        return pl.concat(done)

    @dg.asset(name="bench_floor", ins={"source": dg.AssetIn("bench_input")})
    def bench_floor(source: pl.DataFrame) -> pl.DataFrame:
        return write_each_interval(source, sync=True)

    # The same without fsync: durable against a killed process only, not a crashed machine.
    @dg.asset(name="bench_floor_nosync", ins={"source": dg.AssetIn("bench_input")})
    def bench_floor_nosync(source: pl.DataFrame) -> pl.DataFrame:
        return write_each_interval(source, sync=False)

    assets = [
        bench_input,
        bench_checkpointed,
        bench_timed,
        bench_timed_short,
        bench_plain,
        bench_floor,
        bench_floor_nosync,
    ]
    base_dir = os.path.join(workdir, "overhead")
    resources = {"io_manager": CheckpointIOManager(base_dir=base_dir)}
    quiet = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}

    off = {"ops": {CHECKPOINTED: {"config": {"checkpointing": False}}}}

    seconds: dict[str, list[float]] = {}
    waits: dict[str, list[float]] = {}  # of each checkpointed run, from its own metadata
    flushes: dict[str, list[int]] = {}  # of each checkpointed run, read from what it stored
    with dg.instance_for_test() as instance:

        def materialize(
            selection: dg.AssetsDefinition, config: dict[str, Any]
        ) -> dg.ExecuteInProcessResult:
            outcome = dg.materialize(
                assets,
                selection=[selection],
                instance=instance,
                resources=resources,
                run_config={**quiet, **config},
            )
            assert outcome.success
            return outcome

        def checkpointed(asset: dg.AssetsDefinition, i: int) -> None:
            """A run into a new checkpoint (tag ``run<i>``): its flushes, read from what it
            stored, and how long storage held it up, from its metadata."""
            name = asset.key.path[-1]
            tag = f"run{i}"
            outcome = materialize(asset, {"ops": {name: {"config": {"checkpoint_tag": tag}}}})
            flushes.setdefault(name, []).append(_flushes(base_dir, name, tag))
            event = outcome.asset_materializations_for_node(name)[0]
            wait = event.metadata["storage_wait_seconds"].value
            waits.setdefault(name, []).append(float(wait))  # type: ignore[arg-type]

        runs: dict[str, Callable[[int], None]] = {
            "plain": lambda i: materialize(bench_plain, {}),
            "checkpointed": lambda i: checkpointed(bench_checkpointed, i),
            "checkpointing_false": lambda i: materialize(bench_checkpointed, off),
            "min_flush_seconds_1": lambda i: checkpointed(bench_timed, i),
            "min_flush_seconds_short": lambda i: checkpointed(bench_timed_short, i),
            "floor": lambda i: materialize(bench_floor, {}),
            "floor_without_fsync": lambda i: materialize(bench_floor_nosync, {}),
        }
        materialize(bench_input, {})
        seconds = {key: [] for key in runs}
        cpu: dict[str, list[float]] = {key: [] for key in runs}  # this process, all threads
        # The warm-up rounds warm every path up (first materializations are slower) and are not
        # counted; then the jobs alternate, so background noise hits all alike.
        warmup = sizes.overhead_warmup
        for i in range(warmup + max(sizes.overhead_rounds, sizes.repeat)):
            if i == warmup:
                flushes.clear()
                waits.clear()
            for key, job in runs.items():
                cpu_before = time.process_time()
                took = _timed(functools.partial(job, i))
                if i >= warmup:
                    seconds[key].append(took)
                    cpu[key].append(time.process_time() - cpu_before)

    plain = _median(seconds["plain"])

    def add(figure: str, key: str, ratio: str, limit: float | None = None) -> None:
        result.add(figure, _median(seconds[key]), "s")
        result.add(ratio, _median(seconds[key]) / plain, "x", limit=limit)
        # CPU seconds, which a busy machine inflates less than wall time.
        result.add(f"{ratio} (CPU)", _median(cpu[key]) / _median(cpu["plain"]), "x")

    def add_flushes(figure: str, name: str) -> None:
        result.add(f"{figure}: flushes", _median([float(n) for n in flushes[name]]))

    result.add("plain asset", plain, "s")
    add("checkpointed asset", "checkpointed", "ratio", limit=1.10)
    add_flushes("checkpointed asset", CHECKPOINTED)
    # How long storage held the checkpointed runs up, from their own metadata.
    result.add("storage_wait_seconds", _median(waits[CHECKPOINTED]), "s")
    # The same asset with `checkpointing: false`: input hashing and one call per interval, no
    # storage. What storage adds is the difference to the checkpointed figure.
    add("checkpointing: false", "checkpointing_false", "ratio without storage")
    add("durable-interval floor", "floor", "ratio of the floor")
    add("floor without fsync", "floor_without_fsync", "ratio of the floor without fsync")
    add("min_flush_seconds: 1", "min_flush_seconds_1", "ratio, min_flush_seconds: 1")
    add_flushes("min_flush_seconds: 1", "bench_timed")
    short = f"min_flush_seconds: {SHORT_FLOOR}"
    add(short, "min_flush_seconds_short", f"ratio, {short}")
    add_flushes(short, "bench_timed_short")
    result.details = {
        "rows": sizes.rows,
        "interval": sizes.interval,
        "storage_wait_seconds": waits,
        "flushes": flushes,
        **{f"{key}_seconds": values for key, values in seconds.items()},
        **{f"{key}_cpu_seconds": values for key, values in cpu.items()},
    }
    return result


def _flushes(base_dir: str, asset: str, tag: str) -> int:
    """The flushes a finished run made into a new checkpoint (``RunStats.flushes``): the flush
    numbers its merged file holds, the last rows' included."""
    stored = Checkpoint(open_store(base_dir), checkpoint_name([asset], tag, None))
    rows = stored.read_merged()[0]
    assert rows is not None, f"{asset} stored nothing under {tag}"
    return rows.get_column(SEQ).n_unique()


# -- 2. per-call overhead with a slow function ---------------------------------------------
def per_call(sizes: Sizes, workdir: str) -> Result:
    """A slow function (sleeps per call) checkpointed every call vs the same plain loop."""
    result = Result("per_call", "checkpointing every call vs the same loop without it")
    frame = data.make_input(sizes.per_call_rows)
    fn = data.sleepy(sizes.per_call_sleep)
    size = sizes.per_call_interval
    config = data.settings(size)
    store = open_store(os.path.join(workdir, "per_call"))

    def plain() -> None:
        pl.concat([fn(frame.slice(i, size)) for i in range(0, frame.height, size)])

    def checkpointed() -> None:
        checkpoint = Checkpoint(store, f"run-{uuid.uuid4().hex[:8]}")
        runner.run(fn, runner.prepare(frame, config), checkpoint, config, job=data.JOB)

    times = _alternating({"plain": plain, "checkpointed": checkpointed}, sizes.repeat)
    plain_s, checkpointed_s = times["plain"], times["checkpointed"]
    ratios = [c / p for c, p in zip(checkpointed_s, plain_s, strict=True)]
    calls = math.ceil(frame.height / size)
    overhead_ms = (_median(checkpointed_s) - _median(plain_s)) / calls * 1000
    result.add("plain loop (median)", _median(plain_s), "s")
    result.add("checkpointed (median)", _median(checkpointed_s), "s")
    result.add("overhead per call (difference of medians)", overhead_ms, "ms")
    result.add("ratio (median of rounds)", _median(ratios), "x", limit=1.05)
    result.add("ratio, lowest round", min(ratios), "x")
    result.add("ratio, highest round", max(ratios), "x")
    cpu = _median(times["checkpointed cpu"]) - _median(times["plain cpu"])
    result.add("CPU overhead per call (difference of medians)", cpu / calls * 1000, "ms")
    result.details = {
        "rows": frame.height,
        "interval": size,
        "calls": calls,
        "sleep_seconds": sizes.per_call_sleep,
        "seconds": times,
    }
    return result


def _alternating(sides: dict[str, Callable[[], Any]], repeat: int) -> dict[str, list[float]]:
    """Seconds of each side (and its CPU seconds, as ``"<side> cpu"``), ``repeat`` rounds (two
    at least); the order of the sides alternates from round to round, so neither always runs
    first (warm caches, or a burst of load, would favour one)."""
    seconds: dict[str, list[float]] = {key: [] for n in sides for key in (n, f"{n} cpu")}
    for i in range(max(2, repeat)):  # at least two: each side runs first once
        names = list(sides) if i % 2 == 0 else list(reversed(sides))
        for name in names:
            cpu = time.process_time()
            seconds[name].append(_timed(sides[name]))
            # CPU seconds of this process (all its threads), which a busy machine does not
            # inflate the way it does wall time.
            seconds[f"{name} cpu"].append(time.process_time() - cpu)
    return seconds


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
        runs = [_child("bench.resume_child", source, base_dir, name) for _ in range(sizes.repeat)]
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


def _child(module: str, *args: str, timeout: float = 1800) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    payload: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return payload


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
        self.read_seconds = _timed(lambda: Checkpoint(self.store, self.name).load(id_column))
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
    baseline_read = _timed(lambda: Checkpoint(store, baseline.name).load(data.ID))
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


# -- 5. hashing -----------------------------------------------------------------------------
def hashing_speed(sizes: Sizes, workdir: str) -> Result:
    """Shard assignment plus per-row input hashes of integer ids with short text."""
    result = Result("hashing", "shard assignment + per-row input hash")
    frame = data.make_input(sizes.hash_rows)
    size_mb = (frame.height * 8 + int(frame.get_column(data.TEXT).str.len_bytes().sum())) / 1e6

    def both() -> None:
        hashing.shard_of(frame.get_column(data.ID), 16)
        hashing.row_hashes(frame, [data.ID, data.TEXT])

    def shard() -> None:
        hashing.shard_of(frame.get_column(data.ID), 16)

    both()  # warm up (first calls allocate)
    times = _alternating({"both": both, "shard": shard}, sizes.repeat)
    rates = [frame.height / t / 1e6 for t in times["both"]]
    result.add("rows", frame.height)
    median = frame.height / _median(times["both"]) / 1e6
    result.add("shard + row hash (median)", median, "M rows/s", limit=5.0, op=">=")
    result.add("shard + row hash, slowest round", min(rates), "M rows/s")
    result.add("shard + row hash, fastest round", max(rates), "M rows/s")
    result.add("shard + row hash, bytes (median)", size_mb / _median(times["both"]), "MB/s")
    result.add("shard only (median)", frame.height / _median(times["shard"]) / 1e6, "M rows/s")
    cpu = frame.height / _median(times["both cpu"]) / 1e6
    result.add("shard + row hash per CPU second (median)", cpu, "M rows/s")
    result.details = {"seconds": times, "input_mb": size_mb}
    return result


# -- 7. Ray Data's job-level checkpointing ----------------------------------------------------
def ray_data(sizes: Sizes, workdir: str, enabled: bool) -> Result:
    """The same job through Ray Data with ``CheckpointConfig``, fresh and no-op resume."""
    result = Result("ray", "Ray Data job-level checkpointing, side by side")
    try:
        import ray
    except ImportError:
        result.status = "skipped"
        result.note = 'ray is not installed (pip install -e ".[bench]" to compare with Ray Data)'
        return result
    if not enabled:
        result.status = "skipped"
        result.note = "skipped in smoke runs; pass --ray to run it"
        return result
    folder = os.path.join(workdir, "ray")
    os.makedirs(os.path.join(folder, "input"))
    source = os.path.join(folder, "input", "data.parquet")
    data.make_input(sizes.rows).write_parquet(source)
    config = data.settings(sizes.interval)
    store = open_store(os.path.join(folder, "ours"))

    results: list[pl.DataFrame] = []

    def ours() -> None:
        frame = pl.read_parquet(source)
        stored, _ = runner.run(
            data.score,
            runner.prepare(frame, config),
            Checkpoint(store, "job"),
            config,
            job=data.JOB,
        )
        results.append(stored)

    fresh, again = _timed(ours), _timed(ours)
    theirs = _child("bench.ray_job", str(sizes.rows), folder, str(sizes.interval))
    # The same function on both sides: the same results.
    mine = results[0]
    assert theirs["long_rows"] == (mine.get_column("size") == "long").sum(), theirs
    assert theirs["score_sum"] == mine.get_column("score").sum(), theirs
    result.add("checkpoint-assets fresh", fresh, "s")
    result.add("ray data fresh", theirs["fresh_seconds"], "s")
    result.add("checkpoint-assets no-op resume", again, "s")
    result.add("ray data no-op resume", theirs["resume_seconds"], "s")
    result.add("ray data start-up (ray.init)", theirs["init_seconds"], "s")
    result.add("ray data checkpoint files", theirs["checkpoint_files"])
    result.details = {
        "ray": theirs,
        "ray_version": ray.__version__,
        "rows": sizes.rows,
        "batch_rows": sizes.interval,
    }
    return result
