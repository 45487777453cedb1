"""distribatch's checkpointing beside ours, on the same rows, each flushing every 1,000 rows.

distribatch (PyPI ``distribatch``, the ``bench`` extra) runs batch LLM jobs over DataFrames and
checkpoints them to a directory, resuming by id. Its ``fake`` model answers each row with its
prompt, with no network, so what its runs cost beyond the model is its own machinery. Each side
is timed three ways in this process: without a checkpoint, with one (fresh), and again with the
checkpoint finished (a no-op resume). The sides' functions differ (distribatch renders a prompt
and runs its fake engine per row; ours is a vectorised function), so the figures to compare are
what checkpointing adds to each side's run without it, and the no-op resume.

distribatch's local backends flush every 1,000 rows, a setting it does not expose; ours runs
with ``checkpoint_interval=1000`` to match.
"""

import os

import polars as pl

from bench import data
from bench.report import Result
from bench.scenarios.common import Sizes, peer, timed
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.loop import runner
from checkpoint_assets.engine.storage import open_store

INTERVAL = 1_000  # distribatch's local flush, fixed


def _echo(batch: pl.DataFrame) -> pl.DataFrame:
    """Ours: each row's answer is its text, as distribatch's fake model answers its prompt."""
    return batch.select(data.ID, output=pl.col(data.TEXT))


def distribatch_peer(sizes: Sizes, workdir: str, enabled: bool) -> Result:
    """Both sides, without a checkpoint, fresh with one, and a no-op resume."""
    result = Result("distribatch", "distribatch's checkpointing, side by side")
    distribatch = peer(result, "distribatch", "distribatch", enabled)
    if distribatch is None:
        return result
    folder = os.path.join(workdir, "distribatch")
    frame = data.make_input(sizes.rows)
    rows = frame.to_pandas()
    job = distribatch.GenerateJob(model="fake", prompt="{" + data.TEXT + "}")
    theirs_dir = os.path.join(folder, "theirs")

    def theirs(checkpoint: bool) -> None:
        options = {"checkpoint": theirs_dir, "id_col": data.ID} if checkpoint else {}
        out = job.run(rows, backend="local", **options)
        assert len(out) == sizes.rows and out["output_error"].isna().all()

    config = data.settings(INTERVAL)
    store = open_store(os.path.join(folder, "ours"))

    def ours() -> None:
        stored, _ = runner.run(
            _echo, runner.prepare(frame, config), Checkpoint(store, "job"), config, job=data.JOB
        )
        assert stored.height == sizes.rows

    plain_theirs = timed(lambda: theirs(False))
    fresh_theirs = timed(lambda: theirs(True))
    resume_theirs = timed(lambda: theirs(True))
    plain_ours = timed(lambda: _echo(frame))
    fresh_ours, resume_ours = timed(ours), timed(ours)
    files = sum(len(names) for _, _, names in os.walk(theirs_dir))

    result.add("checkpoint-assets: checkpointing adds", fresh_ours - plain_ours, "s")
    result.add("distribatch: checkpointing adds", fresh_theirs - plain_theirs, "s")
    result.add("checkpoint-assets: no-op resume", resume_ours, "s")
    result.add("distribatch: no-op resume", resume_theirs, "s")
    result.add("checkpoint-assets: run without checkpoint", plain_ours, "s")
    result.add("distribatch: run without checkpoint", plain_theirs, "s")
    result.add("distribatch: checkpoint files", files)
    result.details = {
        "distribatch_version": distribatch.__version__,
        "rows": sizes.rows,
        "flush_rows": INTERVAL,
        "seconds": {
            "ours": {"plain": plain_ours, "fresh": fresh_ours, "resume": resume_ours},
            "theirs": {"plain": plain_theirs, "fresh": fresh_theirs, "resume": resume_theirs},
        },
    }
    return result
