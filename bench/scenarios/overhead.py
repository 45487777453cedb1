"""1. Overhead through Dagster: a checkpointed asset beside a plain one, the durable-interval
floor and the other ways to run the same job.

No ``from __future__ import annotations`` here: Dagster reads the assets' annotations at runtime.
"""

import functools
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dagster as dg
import polars as pl
import pyarrow.parquet as pq

from bench import data
from bench.report import Result
from bench.scenarios.common import Sizes, child, median, timed
from checkpoint_assets import CheckpointIOManager, checkpointed_asset
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.layout import checkpoint_name
from checkpoint_assets.engine.rows import SEQ
from checkpoint_assets.engine.storage import open_store

# A minimum time between flushes short enough that the overhead job flushes several times
# (its calls take about a third of a second): the setting measured beside the 1 s one.
SHORT_FLOOR = 0.05
CHECKPOINTED = "bench_checkpointed"


# -- 1. overhead through Dagster -----------------------------------------------------------
def overhead(sizes: Sizes, workdir: str, with_ray: bool = False) -> Result:
    """A checkpointed asset against a plain Dagster asset writing Parquet, same function."""
    result = Result("overhead", "checkpointed asset vs plain Dagster asset (materialize)")
    frame = data.make_input(sizes.rows)

    @dg.asset(name="bench_input")
    def bench_input() -> pl.DataFrame:
        return frame

    # The checkpointed job, and the same trading the loss bound in rows for one in time
    # (``floor``): flushes at most once per ``floor`` seconds. A floor longer than the run never
    # flushes before the end (the clock starts when the run starts): the whole run is one
    # write, so each is reported with the flushes it made.
    def checkpointed_job(name: str, floor: float | None = None) -> dg.AssetsDefinition:
        @checkpointed_asset(
            source="bench_input",
            id_column=data.ID,
            input_columns=[data.TEXT],
            checkpoint_interval=sizes.interval,
            min_flush_seconds=floor,
            name=name,
        )
        def job(batch: pl.DataFrame) -> pl.DataFrame:
            return data.score(batch)

        return job

    bench_checkpointed = checkpointed_job(CHECKPOINTED)
    bench_timed = checkpointed_job("bench_timed", 1.0)
    bench_timed_short = checkpointed_job("bench_timed_short", SHORT_FLOOR)

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
                took = timed(functools.partial(job, i))
                if i >= warmup:
                    seconds[key].append(took)
                    cpu[key].append(time.process_time() - cpu_before)

    plain = median(seconds["plain"])

    def add(figure: str, key: str, ratio: str, limit: float | None = None) -> None:
        result.add(figure, median(seconds[key]), "s")
        result.add(ratio, median(seconds[key]) / plain, "x", limit=limit)
        # CPU seconds, which a busy machine inflates less than wall time.
        result.add(f"{ratio} (CPU)", median(cpu[key]) / median(cpu["plain"]), "x")

    def add_flushes(figure: str, name: str) -> None:
        result.add(f"{figure}: flushes", median([float(n) for n in flushes[name]]))

    result.add("plain asset", plain, "s")
    add("checkpointed asset", "checkpointed", "ratio", limit=1.10)
    add_flushes("checkpointed asset", CHECKPOINTED)
    # How long storage held the checkpointed runs up, from their own metadata.
    result.add("storage_wait_seconds", median(waits[CHECKPOINTED]), "s")
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
    _added(result, sizes.rows, seconds, cpu)
    ray = _ray_added(sizes, workdir) if with_ray else None
    if ray is not None:
        ray_seconds = ray["seconds"]
        per_million = 1e6 / sizes.rows
        differences = zip(ray_seconds["checkpointed"], ray_seconds["plain"], strict=True)
        ray_added = median([c - p for c, p in differences]) * per_million
        result.add("added per 1M rows: Ray Data's checkpoint (wall)", ray_added, "s")
    result.details = {
        "rows": sizes.rows,
        "interval": sizes.interval,
        "ray": ray,
        "storage_wait_seconds": waits,
        "flushes": flushes,
        **{f"{key}_seconds": values for key, values in seconds.items()},
        **{f"{key}_cpu_seconds": values for key, values in cpu.items()},
    }
    return result


def _added(
    result: Result, rows: int, seconds: dict[str, list[float]], cpu: dict[str, list[float]]
) -> None:
    """What each way adds to the plain asset, per 1M rows: the median over rounds of its
    difference to the plain run of the same round (wall, and this process's CPU)."""
    per_million = 1e6 / rows
    for figure, key, limit in [
        ("checkpointed asset", "checkpointed", 0.22),
        ("the floor (durable Parquet writes, one per interval)", "floor", None),
        ("checkpointing: false", "checkpointing_false", None),
    ]:
        for clock, values, bound in [("wall", seconds, None), ("CPU", cpu, limit)]:
            pairs = zip(values[key], values["plain"], strict=True)
            added = median([mine - plain for mine, plain in pairs]) * per_million
            result.add(f"added per 1M rows: {figure} ({clock})", added, "s", limit=bound)


def _ray_added(sizes: Sizes, workdir: str) -> dict[str, Any] | None:
    """Ray Data's job without and with its checkpoint, in a child process (None without Ray)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return None
    folder = os.path.join(workdir, "overhead-ray")
    os.makedirs(os.path.join(folder, "input"), exist_ok=True)
    data.make_input(sizes.rows).write_parquet(os.path.join(folder, "input", "data.parquet"))
    rounds = str(max(sizes.overhead_rounds, sizes.repeat))
    return child("bench.ray_job", str(sizes.rows), folder, str(sizes.interval), "added", rounds)


def _flushes(base_dir: str, asset: str, tag: str) -> int:
    """The flushes a finished run made into a new checkpoint (``RunStats.flushes``): the flush
    numbers its merged file holds, the last rows' included."""
    stored = Checkpoint(open_store(base_dir), checkpoint_name([asset], tag, None))
    rows = stored.read_merged()[0]
    assert rows is not None, f"{asset} stored nothing under {tag}"
    return rows.get_column(SEQ).n_unique()
