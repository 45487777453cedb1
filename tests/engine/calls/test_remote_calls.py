"""Calls to a remote model: rows per call apart from rows per flush, group commit, broken
functions and usage sums (rate limits: test_throttle.py, test_throttle_policy.py). The engine
runs for real on real checkpoints (local disk and the moto S3 server where storage matters)."""

from __future__ import annotations

import contextlib
import io
import json
import time
from typing import Any

import polars as pl
import pytest
from helpers.rows import Storage, engine_settings, route, tickets

from checkpoint_assets import FunctionError, cli
from checkpoint_assets.engine import Checkpoint, open_store, prepare, run
from checkpoint_assets.engine.settings import RunStats
from checkpoint_assets.engine.storage import Store

ID = "ticket_id"


def _run(
    fn: Any, n: int, storage: Storage, name: str = "job", **kw: Any
) -> tuple[pl.DataFrame, RunStats]:
    s = engine_settings(**kw)
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), name)
    return run(fn, prepare(tickets(n), s), checkpoint, s, job={"test": 1})


@pytest.fixture
def local(tmp_path: Any) -> Storage:
    return (str(tmp_path / "checkpoints"), {})


def _stored(storage: Storage, name: str = "job") -> pl.DataFrame:
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), name)
    meta = checkpoint.meta_file.read()
    assert meta is not None
    return checkpoint.read_result(ID, list(meta.output_schema or {}), meta=meta)


# -- rows per call, rows per flush, group commit --------------------------------------------------
def test_batch_size_sets_rows_per_call_and_the_interval_rows_per_flush(local: Storage) -> None:
    sizes: list[int] = []

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        sizes.append(batch.height)
        return route(batch)

    result, stats = _run(fn, 40, local, batch_size=1, checkpoint_interval=8)

    assert sizes == [1] * 40
    assert stats.calls == 40
    assert 1 <= stats.flushes <= 40 // 8  # parts of 8 rows or more, never a part per row
    assert result.get_column("_error").null_count() == 40


def test_without_batch_size_a_call_takes_one_interval(local: Storage) -> None:
    sizes: list[int] = []

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        sizes.append(batch.height)
        return route(batch)

    _run(fn, 20, local, checkpoint_interval=8)

    assert sizes == [8, 8, 4]


class SlowStore:
    """Wraps a store: each write of a part takes ``delay`` seconds, and its rows are recorded."""

    def __init__(self, store: Store, delay: float) -> None:
        self._store = store
        self.delay = delay
        self.part_rows: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def put(self, path: str, data: bytes) -> None:
        if ".parts/" in path:
            time.sleep(self.delay)
            self.part_rows.append(pl.read_parquet(io.BytesIO(data)).height)
        self._store.put(path, data)


def test_calls_do_not_wait_for_a_slow_store_and_rows_join_the_next_flush(
    storage: Storage,
) -> None:
    base_dir, options = storage
    store = SlowStore(open_store(base_dir, options), delay=0.3)
    s = engine_settings(checkpoint_interval=4, batch_size=1, max_concurrency=4)
    checkpoint = Checkpoint(store, "job")  # type: ignore[arg-type]

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        time.sleep(0.01)
        return route(batch)

    result, _ = run(fn, prepare(tickets(120), s), checkpoint, s, job={"test": 1})

    assert result.get_column("_error").null_count() == 120
    # 120 rows in 10 ms calls, 4 at a time, take ~0.3 s: one part write. Rows done meanwhile
    # go into a few large flushes, not 30 parts of 4 waited for one by one.
    assert store.part_rows, "rows were flushed as parts"
    assert len(store.part_rows) < 120 // 4 // 2
    assert max(store.part_rows) <= s.max_unflushed_rows  # memory stays bounded
    assert sum(store.part_rows) < 120  # the tail goes straight into the merged file
    assert sorted(_stored(storage)[ID].to_list()) == list(range(120))


# -- broken functions -----------------------------------------------------------------------------
def _broken_on_third_call(how: str, calls: list[int]) -> Any:
    def fn(batch: pl.DataFrame) -> Any:
        calls.append(batch.height)
        out = route(batch)
        if len(calls) < 3:
            return out
        if how == "list":
            return out.to_dicts()
        if how == "no-id":
            return out.drop(ID)
        if how == "unknown-ids":
            return out.with_columns(pl.col(ID) + 1000)
        if how == "attribute":
            return batch.no_such_method()
        raise AssertionError(how)

    return fn


@pytest.mark.parametrize("how", ["list", "no-id", "unknown-ids", "attribute"])
def test_a_broken_result_stops_at_once_after_checkpointing_what_is_done(
    local: Storage, how: str
) -> None:
    calls: list[int] = []
    fn = _broken_on_third_call(how, calls)

    with pytest.raises(FunctionError) as raised:
        _run(fn, 40, local, checkpoint_interval=4, max_attempts=3)

    assert "the function is broken, not the endpoint" in str(raised.value)
    assert "this run had finished 8 rows of its own (checkpointed)" in str(raised.value)
    assert len(calls) == 3, "a broken function is not retried"
    stored = _stored(local)
    assert stored.height == 8 and stored.get_column("_error").null_count() == 8


def test_a_function_called_with_a_signature_it_does_not_have_fails_on_the_first_call(
    local: Storage,
) -> None:
    calls = 0

    def two_args(batch: pl.DataFrame, model: str) -> pl.DataFrame:
        nonlocal calls
        calls += 1
        return route(batch)

    with pytest.raises(FunctionError) as raised:
        _run(two_args, 40, local, checkpoint_interval=4)

    assert "TypeError" in str(raised.value) and "model" in str(raised.value)
    assert calls == 0


def test_a_type_error_inside_the_function_is_a_poison_row_not_a_broken_function(
    local: Storage,
) -> None:
    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        if 5 in batch.get_column(ID).to_list():
            return None + 1  # type: ignore[operator,no-any-return]  # a bug that one row hits
        return route(batch)

    result, _ = _run(fn, 12, local, checkpoint_interval=4, max_failed_fraction=1.0)

    failed = result.filter(pl.col("_error").is_not_null())
    assert failed.get_column(ID).to_list() == [5]
    assert "TypeError" in failed.get_column("_error")[0]


# -- usage ----------------------------------------------------------------------------------------
def test_usage_columns_are_summed_for_this_run_and_for_every_stored_row(local: Storage) -> None:
    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        return route(batch).with_columns(tokens=pl.col(ID) % 3 + 1, cost=pl.lit(0.5))

    usage = ("tokens", "cost")
    _, first = _run(fn, 30, local, checkpoint_interval=4, usage_columns=usage)
    expected_tokens = float(sum(i % 3 + 1 for i in range(30)))
    assert first.usage == {"tokens": expected_tokens, "cost": 15.0}
    assert first.usage_total == first.usage

    _, second = _run(fn, 40, local, checkpoint_interval=4, usage_columns=usage)
    assert second.usage == {"tokens": float(sum(i % 3 + 1 for i in range(30, 40))), "cost": 5.0}
    assert second.usage_total == {"tokens": float(sum(i % 3 + 1 for i in range(40))), "cost": 20.0}
    meta = Checkpoint(open_store(*local), "job").meta_file.read()
    assert meta is not None and meta.usage == second.usage_total

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["status", local[0], "--json"]) == 0
    (listed,) = json.loads(out.getvalue())
    assert listed["usage"] == second.usage_total  # what `checkpoint-assets status` shows


def test_a_usage_column_that_is_not_a_numeric_output_is_refused(local: Storage) -> None:
    with pytest.raises(Exception, match=r"usage_columns \['route'\] are not numeric output"):
        _run(route, 8, local, checkpoint_interval=4, usage_columns=("route",))


# -- retried failures are not an outage ---------------------------------------------------------
def test_rerunning_only_stored_failures_that_fail_again_is_not_an_outage(local: Storage) -> None:
    def always_fails(batch: pl.DataFrame) -> pl.DataFrame:
        if (batch.get_column(ID) % 2 == 0).any():  # every even ticket is poison
            raise ValueError("this ticket cannot be routed")
        return route(batch)

    first, _ = _run(always_fails, 32, local, checkpoint_interval=16, max_failed_fraction=1.0)
    assert first.get_column("_error").is_not_null().sum() == 16

    # The rerun retries exactly the 16 failures, in one batch; every call fails again.
    again, stats = _run(always_fails, 32, local, checkpoint_interval=16, max_failed_fraction=1.0)

    assert stats.rows_computed == 16 and stats.failed_calls > 16  # split down to single rows
    assert again.get_column("_error").is_not_null().sum() == 16
