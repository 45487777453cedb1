"""The same job with Ray Data's own job-level checkpointing, in its own process.

Run by ``bench/run.py`` as ``python -m bench.ray_job ROWS WORKDIR BATCH_ROWS``; prints one JSON
object. ``... BATCH_ROWS added ROUNDS`` measures instead what the checkpoint adds to the same job
without it (``added``), for the overhead scenario's added-cost rows. Ray Data reads the input
Parquet, applies the same function with ``map_batches`` and writes Parquet, with
``DataContext.checkpoint_config = CheckpointConfig(id_column=...)``. The second run over the same
input is the no-op resume: Ray loads its checkpoint and filters every row out. Ray's own start-up
(``ray.init``) is reported apart.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench.data import LONG


def score(batch: pa.Table) -> pa.Table:
    """``bench.data.score`` in pyarrow, Ray's native batch format."""
    length = pc.binary_length(batch["text"])
    size = pc.if_else(pc.greater(length, LONG), "long", "short")
    return pa.table({"id": batch["id"], "score": pc.multiply(length, 2), "size": size})


def main(rows: int, workdir: str, batch_rows: int) -> dict[str, Any]:
    import ray
    import ray.data
    from ray.data.checkpoint import CheckpointConfig

    source = os.path.join(workdir, "input")
    started = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    init_seconds = time.perf_counter() - started
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.checkpoint_config = CheckpointConfig(
        id_column="id",
        checkpoint_path=os.path.join(workdir, "ray_checkpoint"),
        delete_checkpoint_on_success=False,
    )
    seconds = []
    for run in range(2):
        output = os.path.join(workdir, f"ray_output_{run}")
        t = time.perf_counter()
        dataset = ray.data.read_parquet(source).map_batches(
            score, batch_format="pyarrow", batch_size=batch_rows
        )
        dataset.write_parquet(output)
        seconds.append(time.perf_counter() - t)
    written = [_rows_in(os.path.join(workdir, f"ray_output_{run}")) for run in range(2)]
    fresh = pq.read_table(os.path.join(workdir, "ray_output_0"))
    files = sum(len(f) for _, _, f in os.walk(os.path.join(workdir, "ray_checkpoint")))
    ray.shutdown()
    return {
        "version": ray.__version__,
        "init_seconds": init_seconds,
        "fresh_seconds": seconds[0],
        "resume_seconds": seconds[1],
        "rows_written": written,
        # What the function computed, for the parent to compare with its own result.
        "long_rows": pc.sum(pc.equal(fresh["size"], "long")).as_py(),
        "score_sum": pc.sum(fresh["score"]).as_py(),
        "checkpoint_files": files,
    }


def added(rows: int, workdir: str, batch_rows: int, rounds: int) -> dict[str, Any]:
    """What Ray Data's checkpoint adds to the same job: rounds of the job without a checkpoint
    and with one into a new folder, in turns (plain first in even rounds), after a warm-up of
    each. Wall seconds: Ray's work runs in its worker processes."""
    import ray
    import ray.data
    from ray.data.checkpoint import CheckpointConfig

    source = os.path.join(workdir, "input")
    ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    seconds: dict[str, list[float]] = {"plain": [], "checkpointed": []}

    def job(side: str, run: int) -> float:
        context.checkpoint_config = (
            CheckpointConfig(
                id_column="id",
                checkpoint_path=os.path.join(workdir, f"ray_added_checkpoint_{run}"),
                delete_checkpoint_on_success=False,
            )
            if side == "checkpointed"
            else None
        )
        t = time.perf_counter()
        dataset = ray.data.read_parquet(source).map_batches(
            score, batch_format="pyarrow", batch_size=batch_rows
        )
        dataset.write_parquet(os.path.join(workdir, f"ray_added_{side}_{run}"))
        return time.perf_counter() - t

    for run in range(rounds + 1):  # round 0 warms both up and is not counted
        sides = ["plain", "checkpointed"] if run % 2 == 0 else ["checkpointed", "plain"]
        for side in sides:
            took = job(side, run)
            if run:
                seconds[side].append(took)
    ray.shutdown()
    return {"version": ray.__version__, "seconds": seconds}


def _rows_in(folder: str) -> int:
    """Rows Ray wrote (a no-op resume writes nothing, not even the folder)."""
    return pq.read_table(folder).num_rows if os.path.isdir(folder) else 0


if __name__ == "__main__":
    if sys.argv[4:5] == ["added"]:
        print(json.dumps(added(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[5]))))
    else:
        print(json.dumps(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))))
