"""7. Ray Data's job-level checkpointing, the same job side by side."""

import os

import polars as pl

from bench import data
from bench.report import Result
from bench.scenarios.common import Sizes, child, peer, timed
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.loop import runner
from checkpoint_assets.engine.storage import open_store


# -- 7. Ray Data's job-level checkpointing ----------------------------------------------------
def ray_data(sizes: Sizes, workdir: str, enabled: bool) -> Result:
    """The same job through Ray Data with ``CheckpointConfig``, fresh and no-op resume."""
    result = Result("ray", "Ray Data job-level checkpointing, side by side")
    if peer(result, "ray.data", "Ray Data", enabled) is None:
        return result
    import ray

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

    fresh, again = timed(ours), timed(ours)
    theirs = child("bench.ray_job", str(sizes.rows), folder, str(sizes.interval))
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
