"""dedupe=True: one call per distinct input; copies share the value or the error."""

from __future__ import annotations

from collections import Counter

import polars as pl
from helpers.jobs import Storage, build_job, stats, tickets

# tickets(n) has subject "s<i % 7>": 7 distinct subjects.
DISTINCT = 7


def test_dedupe_calls_the_function_once_per_distinct_input(storage: Storage) -> None:
    seen: Counter[str] = Counter()

    def route(batch: pl.DataFrame) -> pl.DataFrame:
        seen.update(batch.get_column("subject").to_list())
        return batch.select("ticket_id", route=pl.col("subject").str.to_uppercase())

    job = build_job(storage, tickets(100), fn=route, input_columns=["subject"], dedupe=True)

    result = job.materialize()

    assert seen == {f"s{i}": 1 for i in range(DISTINCT)}
    assert len(job.calls) == 2  # 7 distinct inputs in batches of 4
    metadata = stats(result)
    assert (metadata["rows_computed"], metadata["rows_reused"]) == (DISTINCT, 100 - DISTINCT)
    out = job.checkpoint().read_result("ticket_id", ["route"])
    expected = tickets(100).select("ticket_id", route=pl.col("subject").str.to_uppercase())
    assert out.sort("ticket_id").select("ticket_id", "route").equals(expected)
    assert out.get_column("_error").null_count() == 100


def test_copies_share_an_error_and_are_retried_with_one_call(storage: Storage) -> None:
    broken = {"s3"}

    def route(batch: pl.DataFrame) -> pl.DataFrame:
        if broken.intersection(batch.get_column("subject").to_list()):
            raise ValueError("subject s3 is unreadable")
        return batch.select("ticket_id", route=pl.col("subject").str.to_uppercase())

    df = tickets(100)
    copies = df.filter(pl.col("subject") == "s3").height
    job = build_job(
        storage, df, fn=route, input_columns=["subject"], dedupe=True, max_failed_fraction=0.5
    )

    first = job.materialize()

    out = job.checkpoint().read_result("ticket_id", ["route"])
    failed = out.filter(pl.col("_error").is_not_null())
    assert failed.height == copies == stats(first)["rows_failed"]
    assert failed.get_column("_error").unique().to_list() == [
        "ValueError: subject s3 is unreadable"
    ]
    # the batch with s3: 3 attempts, then halves of 2 and 1 rows; the other batch: 1 call
    assert len(job.calls) == 1 + 3 + 2 + 2

    broken.clear()
    job.calls.clear()
    second = job.materialize()

    assert len(job.calls) == 1 and len(job.calls[0]) == 1
    metadata = stats(second)
    assert (metadata["rows_computed"], metadata["rows_reused"]) == (1, copies - 1)
    assert metadata["rows_failed"] == 0
