"""2 and 5. The engine's cost per call (a slow function), and hashing speed."""

import math
import os
import uuid

import polars as pl

from bench import data
from bench.report import Result
from bench.scenarios.common import Sizes, alternating, median
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.loop import runner
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.storage import open_store


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

    times = alternating({"plain": plain, "checkpointed": checkpointed}, sizes.repeat)
    plain_s, checkpointed_s = times["plain"], times["checkpointed"]
    ratios = [c / p for c, p in zip(checkpointed_s, plain_s, strict=True)]
    calls = math.ceil(frame.height / size)
    overhead_ms = (median(checkpointed_s) - median(plain_s)) / calls * 1000
    result.add("plain loop (median)", median(plain_s), "s")
    result.add("checkpointed (median)", median(checkpointed_s), "s")
    result.add("overhead per call (difference of medians)", overhead_ms, "ms")
    result.add("ratio (median of rounds)", median(ratios), "x", limit=1.05)
    result.add("ratio, lowest round", min(ratios), "x")
    result.add("ratio, highest round", max(ratios), "x")
    cpu = median(times["checkpointed cpu"]) - median(times["plain cpu"])
    result.add("CPU overhead per call (difference of medians)", cpu / calls * 1000, "ms")
    result.details = {
        "rows": frame.height,
        "interval": size,
        "calls": calls,
        "sleep_seconds": sizes.per_call_sleep,
        "seconds": times,
    }
    return result


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
    times = alternating({"both": both, "shard": shard}, sizes.repeat)
    rates = [frame.height / t / 1e6 for t in times["both"]]
    result.add("rows", frame.height)
    rate = frame.height / median(times["both"]) / 1e6
    result.add("shard + row hash (median)", rate, "M rows/s", limit=5.0, op=">=")
    result.add("shard + row hash, slowest round", min(rates), "M rows/s")
    result.add("shard + row hash, fastest round", max(rates), "M rows/s")
    result.add("shard + row hash, bytes (median)", size_mb / median(times["both"]), "MB/s")
    result.add("shard only (median)", frame.height / median(times["shard"]) / 1e6, "M rows/s")
    cpu = frame.height / median(times["both cpu"]) / 1e6
    result.add("shard + row hash per CPU second (median)", cpu, "M rows/s")
    result.details = {"seconds": times, "input_mb": size_mb}
    return result
