"""Inputs, functions and prebuilt checkpoints shared by the scenarios.

Inputs look like the product's users' tables: a unique integer id and a short text per row
(``"ticket 123456 about billing"``). The same ``(rows, seed)`` always gives the same frame, so
a subprocess can rebuild the input its parent used.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import polars as pl

from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.loop import runner
from checkpoint_assets.engine.storage import open_store

ID = "id"
TEXT = "text"
JOB = {"bench": 1}
LONG = 26  # texts of more bytes are "long" in ``score``
_TOPICS = ["billing", "login", "refund", "shipping", "outage", "invoice", "password", "other"]


def make_input(rows: int, seed: int = 0) -> pl.DataFrame:
    """``rows`` rows: ``id`` (0..rows-1, sorted) and a short ``text``."""
    rng = np.random.default_rng(seed)
    numbers = pl.Series(rng.integers(0, 1_000_000, rows)).cast(pl.String)
    topics = pl.Series(_TOPICS).gather(rng.integers(0, len(_TOPICS), rows))
    return pl.DataFrame(
        {ID: np.arange(rows, dtype=np.int64), TEXT: "ticket " + numbers + " about " + topics}
    )


def score(batch: pl.DataFrame) -> pl.DataFrame:
    """A cheap vectorised function: two output columns computed from the text
    (``bench/ray_job.py`` has the same in pyarrow, for Ray Data)."""
    length = pl.col(TEXT).str.len_bytes()
    return batch.select(
        ID,
        (length * 2).alias("score"),
        pl.when(length > LONG).then(pl.lit("long")).otherwise(pl.lit("short")).alias("size"),
    )


def sleepy(seconds: float) -> Callable[[pl.DataFrame], pl.DataFrame]:
    """``score`` after sleeping ``seconds`` per call, like a remote endpoint."""

    def call(batch: pl.DataFrame) -> pl.DataFrame:
        time.sleep(seconds)
        return score(batch)

    return call


def settings(interval: int) -> runner.Settings:
    """Engine settings of every scenario: the text is the input, no retry delays."""
    return runner.Settings(
        id_column=ID,
        input_columns=(TEXT,),
        checkpoint_interval=interval,
        retry_delay_seconds=0.0,
        progress_seconds=1e9,
    )


def build_finished(base_dir: str, name: str, frame: pl.DataFrame, interval: int) -> None:
    """Write a fully finished checkpoint of ``score`` over ``frame`` through the engine."""
    config = settings(interval)
    checkpoint = Checkpoint(open_store(base_dir), name)
    runner.run(score, runner.prepare(frame, config), checkpoint, config, job=JOB)
