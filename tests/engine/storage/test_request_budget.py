"""What a shard costs in object-store requests: counted by the moto server on 127.0.0.1, held to
``Settings.request_budget`` (the formula of ``engine/storage/base.py`` and docs/object-storage.md).

A fast shard pays for time, not rows: on S3 it flushes at most once per ``min_flush_seconds``
(5 s), so a fast shard of any size costs about the 13 requests of starting and finishing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import polars as pl
from helpers.rows import Storage

from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.checkpoints.compaction import COMPACT_AT
from checkpoint_assets.engine.storage.objects import ObjectStore


def _rows(n: int) -> pl.DataFrame:
    return pl.DataFrame({"id": range(n), "text": [f"row {i}" for i in range(n)]})


def _fast(batch: pl.DataFrame) -> pl.DataFrame:
    return batch.select("id", length=pl.col("text").str.len_bytes())


def _served(moto_s3: Any, storage: Storage) -> dict[str, int]:
    """Requests the server served for the storage's bucket, without the test's own."""
    served = moto_s3.requests(storage[0].removeprefix("s3://").split("/")[0])
    del served["BUCKET PUT"]  # the test made the bucket
    return dict(served)


def _run(storage: Storage, rows: int, fn: Callable[..., Any], **settings: Any) -> Any:
    s = Settings(id_column="id", input_columns=("text",), retry_delay_seconds=0.0, **settings)
    checkpoint = Checkpoint(open_store(*storage), "shard")
    result, stats = run(fn, prepare(_rows(rows), s), checkpoint, s, job={"test": 1})
    assert result.height == rows
    return s, stats


def test_fast_rows_on_s3_cost_requests_by_time_not_by_rows(
    new_s3_storage: Callable[[], Storage], moto_s3: Any
) -> None:
    storage = new_s3_storage()
    started = time.monotonic()
    s, stats = _run(storage, 20_000, _fast)  # 1,250 calls of 16 rows
    seconds = time.monotonic() - started

    served = _served(moto_s3, storage)
    assert served == stats.requests  # what the run reports is what the server served
    # At most one flush per min_flush_seconds (5 s on S3), whatever the rows.
    assert stats.flushes <= 1 + seconds / ObjectStore.min_flush_seconds
    assert sum(served.values()) <= s.request_budget(stats.flushes, seconds)


def test_many_flushes_on_s3_stay_within_the_request_budget(
    new_s3_storage: Callable[[], Storage], moto_s3: Any
) -> None:
    storage = new_s3_storage()

    def slow(batch: pl.DataFrame) -> pl.DataFrame:
        time.sleep(0.01)  # a part is written before the next interval is done: no group commit
        return _fast(batch)

    started = time.monotonic()
    s, stats = _run(storage, 800, slow, checkpoint_interval=4, min_flush_seconds=0.0)
    seconds = time.monotonic() - started

    assert stats.flushes > COMPACT_AT  # compaction ran
    served = _served(moto_s3, storage)
    assert served == stats.requests
    assert sum(served.values()) <= s.request_budget(stats.flushes, seconds)
    # Every flush but the last is a part: the budget is not loose by more than the compactions'
    # rounding and the last flush.
    assert sum(served.values()) >= s.request_budget(stats.flushes, 0) - 4
