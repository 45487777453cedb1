"""Input rows, engine settings and functions the tests share, with no Dagster: what
``tests/engine/`` builds its runs from (``jobs.py`` builds Dagster jobs on them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import polars as pl

from checkpoint_assets.engine.settings import Settings
from checkpoint_assets.engine.sharding.hashing import shard_of

Storage = tuple[str, dict[str, Any]]


def tickets(n: int, *, start: int = 0) -> pl.DataFrame:
    """``n`` input rows with integer ids ``start..start+n-1``."""
    ids = list(range(start, start + n))
    return pl.DataFrame(
        {"ticket_id": ids, "subject": [f"s{i % 7}" for i in ids], "body": [f"b{i}" for i in ids]}
    )


def engine_settings(**kw: Any) -> Settings:
    """Engine ``Settings`` for ``tickets``' ``body``, with no pause before a retry or between
    flushes and no progress lines; ``kw`` adds or overrides settings."""
    base: dict[str, Any] = {
        "id_column": "ticket_id",
        "input_columns": ("body",),
        "retry_delay_seconds": 0.0,
        "min_flush_seconds": 0.0,
        "progress_seconds": 3600.0,
    }
    return Settings(**(base | kw))


def route(batch: pl.DataFrame) -> pl.DataFrame:
    """The default function: an output derived from the input, so a changed input shows."""
    return batch.select("ticket_id", route=pl.col("body").str.to_uppercase())


def poisoned(ids: set[int], error: str | None = None) -> Callable[[pl.DataFrame], pl.DataFrame]:
    """``route``, raising on any batch that holds one of ``ids`` (the caller may change the set).

    The error names the ids, unless ``error`` gives one message for all.
    """

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        bad = ids.intersection(batch.get_column("ticket_id").to_list())
        if bad:
            raise ValueError(error or f"cannot route ticket(s) {sorted(bad)}")
        return route(batch)

    return fn


def ids_in_shard(df: pl.DataFrame, shard: int, count: int) -> list[int]:
    """The ticket ids of ``df`` that shard ``shard`` of ``count`` processes."""
    mask = shard_of(df.get_column("ticket_id"), count) == shard
    return df.filter(pl.Series(mask)).get_column("ticket_id").to_list()
