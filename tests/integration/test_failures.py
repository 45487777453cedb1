"""Failures: poison rows, transient errors, outages, the failed-row budget, async concurrency.

Every test counts the calls of the user's function; the figures are in the assertions.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import (
    Job,
    Storage,
    build_job,
    ids_in_shard,
    poisoned,
    route,
    run_logs,
    stats,
    tickets,
)

from checkpoint_assets import CheckpointError, checkpointed_asset, shard_partitions
from checkpoint_assets.engine.calls.caller import outage_threshold

POISON = 777


def error_of(result: dg.ExecuteInProcessResult) -> tuple[str, str]:
    """The class name and message of the user-facing error that failed the run's step."""
    events = result.get_step_failure_events()
    assert events, "the run did not fail"
    error = events[0].step_failure_data.error
    assert error is not None
    while error.cause is not None and error.cls_name.startswith("Dagster"):
        error = error.cause
    return error.cls_name, error.message


def output(result: dg.ExecuteInProcessResult) -> pl.DataFrame:
    """What the run's materialization of the checkpointed asset returned."""
    value = result.output_for_node("routed")
    assert isinstance(value, pl.DataFrame)
    return value


def stored(job: Job, partition: str | None = None) -> pl.DataFrame:
    """Every row the checkpoint holds (merged file and parts), with bookkeeping columns."""
    return job.checkpoint(partition).load("ticket_id").rows


def test_one_poison_row_among_2000_fails_alone_and_a_second_run_computes_only_it(
    storage: Storage,
) -> None:
    poison = {POISON}
    job = build_job(
        storage,
        tickets(2000),
        fn=poisoned(poison),
        checkpoint_interval=16,
        max_failed_fraction=0.01,
        min_flush_seconds=0,
    )

    first = job.materialize()

    result = output(first)
    failed = result.filter(pl.col("_error").is_not_null())
    assert failed.get_column("ticket_id").to_list() == [POISON]
    assert "cannot route ticket(s) [777]" in failed.get_column("_error")[0]
    ok = result.filter(pl.col("_error").is_null())
    assert ok.height == 1999 and ok.get_column("route").null_count() == 0
    assert stats(first)["rows_failed"] == 1
    # 124 clean batches + the poison batch: 3 attempts, then halves 8, 4, 2, 1 (two calls each).
    calls = len(job.calls)
    batches = math.ceil(2000 / 16)
    assert calls == batches - 1 + 3 + 2 * int(math.log2(16)), calls
    attempts = stored(job).filter(pl.col("ticket_id") == POISON).get_column("_attempts")
    assert attempts.to_list() == [3 + 4]

    poison.clear()  # the cause is fixed
    job.calls.clear()
    second = job.materialize()

    assert job.computed_ids() == [POISON]
    assert len(job.calls) == 1
    metadata = stats(second)
    assert (metadata["rows_computed"], metadata["rows_resumed"], metadata["rows_failed"]) == (
        1,
        1999,
        0,
    )
    assert output(second).get_column("_error").null_count() == 2000


@pytest.mark.parametrize(
    ("calls_before_outage", "concurrency"),
    [(0, 1), (10, 1), (0, 4), (10, 4)],
    ids=["down-from-start", "down-after-10-calls", "down-from-start-4-threads", "4-threads"],
)
def test_an_endpoint_outage_stops_the_run_after_a_few_calls_and_marks_nothing_failed(
    storage: Storage, calls_before_outage: int, concurrency: int
) -> None:
    down = {"after": calls_before_outage}
    lock = threading.Lock()

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        with lock:
            if down["after"] <= 0:
                raise ConnectionError("503 Service Unavailable")
            down["after"] -= 1
        return batch.select("ticket_id", route=pl.col("body"))

    job = build_job(
        storage,
        tickets(2000),
        fn=fn,
        checkpoint_interval=16,
        min_flush_seconds=0,
        max_concurrency=concurrency,
    )

    first = job.materialize(raise_on_error=False)

    assert not first.success
    name, message = error_of(first)
    assert name == "OutageError"
    assert "503 Service Unavailable" in message and "resumes" in message
    failing_calls = len(job.calls) - calls_before_outage
    # 3 attempts + splitting depth: 12 failed calls in a row; threads in flight finish theirs.
    threshold = outage_threshold(3, 16)
    assert threshold == 12
    assert threshold <= failing_calls <= threshold + concurrency - 1
    rows = stored(job)
    done = calls_before_outage * 16
    assert rows.height == done  # everything done before is checkpointed ...
    if done:
        assert rows.get_column("_error").null_count() == done  # ... and nothing marked failed

    down["after"] = 10**9  # the endpoint is back
    job.calls.clear()
    second = job.materialize()

    metadata = stats(second)
    assert metadata["rows_resumed"] == done
    assert metadata["rows_computed"] == 2000 - done
    assert metadata["rows_failed"] == 0
    assert len(job.calls) == math.ceil((2000 - done) / 16)


def test_transient_errors_succeed_on_retry(storage: Storage) -> None:
    seen: set[int] = set()

    def flaky(batch: pl.DataFrame) -> pl.DataFrame:
        first = batch.get_column("ticket_id")[0]
        if first not in seen:
            seen.add(first)
            raise TimeoutError("read timed out")
        return batch.select("ticket_id", route=pl.col("body"))

    job = build_job(storage, tickets(64), fn=flaky, checkpoint_interval=16)

    result = job.materialize()

    assert stats(result)["rows_failed"] == 0
    assert len(job.calls) == 2 * 4  # each of the 4 batches: one failure, one success
    assert stored(job).get_column("_attempts").unique().to_list() == [2]


def test_each_row_keeps_the_attempts_of_its_own_batch_within_one_flush(storage: Storage) -> None:
    seen: set[int] = set()

    def flaky_evens(batch: pl.DataFrame) -> pl.DataFrame:
        first = batch.get_column("ticket_id")[0]
        if first % 32 == 0 and first not in seen:  # every other batch of 16 fails once
            seen.add(first)
            raise TimeoutError("read timed out")
        return batch.select("ticket_id", route=pl.col("body"))

    job = build_job(storage, tickets(64), fn=flaky_evens, checkpoint_interval=64, batch_size=16)

    assert job.materialize().success
    rows = stored(job).sort("ticket_id")
    expected = [2 if i // 16 % 2 == 0 else 1 for i in range(64)]
    assert rows.get_column("_attempts").to_list() == expected


@pytest.mark.parametrize("over", [True, False], ids=["above", "at"])
def test_max_failed_fraction_fails_the_partition_above_it_and_reports_rows_failed_at_it(
    storage: Storage, over: bool
) -> None:
    df = tickets(200)
    shard_ids = ids_in_shard(df, 0, 2)
    bad = set(shard_ids[:2])
    fraction = len(bad) / len(shard_ids)
    job = build_job(
        storage,
        df,
        fn=poisoned(bad),
        partitions_def=shard_partitions(2),
        max_failed_fraction=fraction - 1e-9 if over else fraction,
    )

    result = job.materialize("0-of-2", raise_on_error=False)

    status = job.instance.get_status_by_partition(
        dg.AssetKey("routed"), ["0-of-2"], shard_partitions(2)
    )
    rows = job.checkpoint("0-of-2").read_result("ticket_id", ["route"])
    assert rows.height == len(shard_ids)  # everything else was checkpointed either way
    assert set(rows.filter(pl.col("_error").is_not_null()).get_column("ticket_id")) == bad
    if over:
        assert not result.success
        name, message = error_of(result)
        assert name == "TooManyFailuresError"
        assert "max_failed_fraction" in message and "retried on the next run" in message
        assert status == {"0-of-2": dg.AssetPartitionStatus.FAILED}
    else:
        assert result.success
        assert stats(result)["rows_failed"] == 2
        assert status == {"0-of-2": dg.AssetPartitionStatus.MATERIALIZED}


def test_retry_failed_false_keeps_failures_until_a_run_asks_for_them(storage: Storage) -> None:
    bad = {5}
    job = build_job(
        storage, tickets(40), fn=poisoned(bad), max_failed_fraction=0.5, retry_failed=False
    )
    job.materialize()
    bad.clear()
    job.calls.clear()

    kept = job.materialize()

    assert job.calls == []
    assert stats(kept)["rows_failed"] == 1
    assert stats(kept)["rows_resumed"] == 39

    retried = job.materialize(retry_failed=True)

    assert job.computed_ids() == [5]
    assert stats(retried)["rows_failed"] == 0


def test_async_function_with_concurrency_overlaps_calls_and_flushes_as_they_complete(
    storage: Storage,
) -> None:
    started: set[int] = set()
    observed: dict[str, bool] = {}

    async def wait_for(condition: Any, seconds: float = 30.0) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if await condition():
                return True
            await asyncio.sleep(0.02)
        return False

    async def first_batch_is_stored() -> bool:
        try:
            rows = await asyncio.to_thread(stored, job)
        except FileNotFoundError:  # a part compacted away while listing: look again
            return False
        return rows.height > 0 and {0, 1, 2, 3} <= set(rows.get_column("ticket_id"))

    async def second_batch_started() -> bool:
        return 4 in started

    async def fn(batch: pl.DataFrame) -> pl.DataFrame:
        first = batch.get_column("ticket_id")[0]
        started.add(first)
        if first == 0:
            observed["overlap"] = await wait_for(second_batch_started)
        else:
            observed["flushed_while_running"] = await wait_for(first_batch_is_stored)
        return batch.select("ticket_id", route=pl.col("body"))

    job = build_job(storage, tickets(8))

    @checkpointed_asset(
        source="tickets",
        id_column="ticket_id",
        name="routed",
        checkpoint_interval=4,
        max_concurrency=2,
        min_flush_seconds=0,
        retry_delay_seconds=0,
    )
    async def routed(batch: pl.DataFrame) -> pl.DataFrame:
        job.calls.append(batch.get_column("ticket_id").to_list())
        return await fn(batch)

    job.asset = routed

    result = job.materialize()

    assert observed == {"overlap": True, "flushed_while_running": True}
    assert stats(result)["rows_computed"] == 8
    assert stats(result)["calls"] == 2
    assert output(result).get_column("_error").null_count() == 8


def test_an_output_column_parquet_cannot_store_fails_at_the_first_result_naming_it(
    storage: Storage,
) -> None:
    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        return batch.select(
            "ticket_id", route=pl.col("body"), big=pl.col("ticket_id").cast(pl.Int128)
        )

    job = build_job(storage, tickets(12), fn=fn)

    with pytest.raises(CheckpointError) as raised:
        job.materialize()

    assert "cannot store: big: Int128" in str(raised.value)
    assert "Cast them in the function" in str(raised.value)
    assert len(job.calls) == 1  # stopped at the first result
    assert stored(job).height == 0


def test_a_function_that_returns_no_row_for_some_ids_is_told_to_return_one_per_id(
    tmp_path: Any,
) -> None:
    def skips_odd_ids(batch: pl.DataFrame) -> pl.DataFrame:
        return route(batch.filter(pl.col("ticket_id") % 2 == 0))  # a bug: odd ids get no row

    job = build_job(local(tmp_path), tickets(40), fn=skips_odd_ids)

    result = job.materialize(raise_on_error=False)

    name, message = error_of(result)
    assert name == "TooManyFailuresError"
    assert "returned no row for 20 of the 40 ids" in message
    assert "ids [1, 3, 5, 7, 9]" in message
    assert "return one row per input id" in message and "raise for the rows" in message
    assert "raise `max_failed_fraction`" not in message  # tolerating a bug is not the fix
    failed = stored(job).filter(pl.col("_error").is_not_null()).get_column("ticket_id")
    assert failed.sort().to_list() == list(range(1, 40, 2))  # stored as failed, retried next run


def test_failed_rows_with_an_error_still_suggest_max_failed_fraction(tmp_path: Any) -> None:
    job = build_job(local(tmp_path), tickets(40), fn=poisoned({3}))

    result = job.materialize(raise_on_error=False)

    name, message = error_of(result)
    assert name == "TooManyFailuresError"
    assert "no row" not in message and "raise `max_failed_fraction`" in message


def test_a_broken_function_says_what_this_run_did_apart_from_what_the_checkpoint_holds(
    tmp_path: Any,
) -> None:
    broken = False

    def breaks(batch: pl.DataFrame) -> Any:
        return "not a table" if broken else route(batch)

    job = build_job(local(tmp_path), tickets(40), fn=breaks)
    job.materialize(limit=12)  # 12 rows checkpointed by an earlier run
    broken = True

    result = job.materialize(raise_on_error=False)

    name, message = error_of(result)
    assert name == "FunctionError"
    assert "this run had finished 0 rows of its own" in message
    assert "0 rows done before are checkpointed" not in message
    [line] = [m for m in run_logs(result, job.instance) if "rows are checkpointed at" in m]
    assert (
        "12 rows are checkpointed at " in line and "counting this run's and earlier runs'" in line
    )


def local(tmp_path: Any) -> Storage:
    """A local checkpoint root: what these tests check is wording, the same on any store."""
    return str(tmp_path / "checkpoints"), {}
