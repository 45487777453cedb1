"""Per-row functions (a dict in, a dict out), sync and ``async def``, through the engine on real
checkpoints: results stored and resumed, poison rows, rate limits, broken results, and output
types checked over the rows as they are for frames."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import polars as pl
import pytest
from helpers.rows import Storage, engine_settings, tickets

from checkpoint_assets import FunctionError, JobMismatchError
from checkpoint_assets.engine import Checkpoint, PerRow, Settings, open_store, prepare, run
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.settings import RunStats

ID = "ticket_id"


def _settings(**kw: Any) -> Settings:
    base = {"input_columns": ("subject", "body"), "checkpoint_interval": 8, "max_concurrency": 4}
    return engine_settings(**(base | kw))


def _run(fn: Any, n: int, storage: Storage, **kw: Any) -> tuple[pl.DataFrame, RunStats]:
    s = _settings(**kw)
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), "job")
    return run(PerRow(fn), prepare(tickets(n), s), checkpoint, s, job={"test": 1})


def _stored(storage: Storage) -> pl.DataFrame:
    """Every stored row with its bookkeeping columns, by id."""
    base_dir, options = storage
    return Checkpoint(open_store(base_dir, options), "job").load(ID).rows.sort(ID)


@pytest.fixture
def local(tmp_path: Any) -> Storage:
    return (str(tmp_path / "checkpoints"), {})


class Routes:
    """A per-row function, sync or async, that records the rows it was given."""

    def __init__(self, *, asynchronous: bool, poison: set[int] | None = None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.poison = poison or set()
        self.lock = threading.Lock()
        self.fn: Any = self._async if asynchronous else self._sync

    def _route(self, row: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.rows.append(dict(row))
        if row[ID] in self.poison:
            raise ValueError(f"cannot route ticket {row[ID]}")
        return {"route": row["body"].upper(), "length": len(row["body"])}

    def _sync(self, row: dict[str, Any]) -> dict[str, Any]:
        return self._route(row)

    async def _async(self, row: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0.001)
        return self._route(row)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def asynchronous(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def test_each_row_arrives_as_a_dict_and_its_outputs_are_stored(
    local: Storage, asynchronous: bool
) -> None:
    routes = Routes(asynchronous=asynchronous)

    result, stats = _run(routes.fn, 50, local)

    assert sorted(r[ID] for r in routes.rows) == list(range(50))
    assert routes.rows[0].keys() == {ID, "subject", "body"}
    assert stats.calls == 50
    expected = tickets(50).select(
        ID, route=pl.col("body").str.to_uppercase(), length=pl.col("body").str.len_chars()
    )
    stored = _stored(local)
    assert stored.select(ID, "route", "length").equals(
        expected.with_columns(pl.col("length").cast(pl.Int64))
    )
    assert stored.get_column("_error").null_count() == 50
    assert stored.get_column("_attempts").to_list() == [1] * 50
    assert result.sort(ID).get_column("route").to_list() == expected.get_column("route").to_list()
    assert 1 < stats.flushes < 50  # built and flushed in bulk, not a part per row


def test_a_second_run_resumes_and_calls_only_the_new_rows(
    local: Storage, asynchronous: bool
) -> None:
    _run(Routes(asynchronous=asynchronous).fn, 30, local)
    routes = Routes(asynchronous=asynchronous)

    _, stats = _run(routes.fn, 40, local)

    assert sorted(r[ID] for r in routes.rows) == list(range(30, 40))
    assert stats.rows_resumed == 30
    assert _stored(local).height == 40


def test_a_poison_row_is_stored_as_failed_and_its_neighbours_succeed(
    local: Storage, asynchronous: bool
) -> None:
    routes = Routes(asynchronous=asynchronous, poison={7})

    result, stats = _run(routes.fn, 20, local, max_attempts=2, max_failed_fraction=0.1)

    stored = _stored(local)
    failed = stored.filter(pl.col("_error").is_not_null())
    assert failed.get_column(ID).to_list() == [7]
    assert "cannot route ticket 7" in failed.get_column("_error")[0]
    assert failed.get_column("_attempts").to_list() == [2]
    assert stats.failed_calls == 2
    assert result.filter(pl.col("_error").is_null()).height == 19


def test_a_rate_limit_pauses_and_the_row_is_called_again(
    local: Storage, asynchronous: bool
) -> None:
    refused: list[int] = []
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")

    def route(row: dict[str, Any]) -> dict[str, Any]:
        if row[ID] == 3 and not refused:
            refused.append(row[ID])
            response = httpx.Response(429, headers={"Retry-After": "0.1"}, request=request)
            raise httpx.HTTPStatusError("429", request=request, response=response)
        return {"route": row["body"]}

    async def aroute(row: dict[str, Any]) -> dict[str, Any]:
        return route(row)

    started = time.monotonic()
    _, stats = _run(aroute if asynchronous else route, 12, local)

    assert refused == [3]
    assert stats.throttled_calls == 1, "the refused call waited and was sent again"
    assert time.monotonic() - started >= 0.1  # it waited for Retry-After
    stored = _stored(local)
    assert stored.get_column("_error").null_count() == 12  # not a failure of the row
    assert stored.filter(pl.col(ID) == 3).get_column("_attempts").to_list() == [1]


@pytest.mark.parametrize(
    ("returned", "problem"),
    [
        (lambda row: pl.DataFrame({ID: [row[ID]]}), "it returned DataFrame"),
        (lambda row: [row["body"]], "it returned list"),
        (lambda row: {"route": 1, "_error": "x"}, "reserved column names ['_error']"),
        (lambda row: {ID: row[ID] + 1000, "route": 1}, "it returned the id"),
        (lambda row: {"route": 1} if row[ID] % 2 else {"other": 1}, "the same output columns"),
    ],
    ids=["a-frame", "a-list", "reserved-name", "another-id", "keys-change"],
)
def test_a_broken_result_stops_with_a_function_error_after_storing_what_is_done(
    local: Storage, returned: Any, problem: str
) -> None:
    with pytest.raises(FunctionError) as raised:
        _run(returned, 40, local, max_concurrency=1)

    assert problem in str(raised.value)
    assert raised.value.remedy


def test_the_id_may_be_returned_and_rows_may_return_none(local: Storage) -> None:
    def route(row: dict[str, Any]) -> dict[str, Any]:
        return {ID: row[ID], "route": None if row[ID] < 10 else row["body"]}

    _run(route, 20, local)

    stored = _stored(local)
    assert stored.schema["route"] == pl.String
    assert stored.get_column("route").null_count() == 10


def test_an_output_whose_type_changes_between_rows_is_refused(local: Storage) -> None:
    def route(row: dict[str, Any]) -> dict[str, Any]:
        return {"score": 1 if row[ID] < 12 else "high"}

    with pytest.raises(JobMismatchError) as raised:
        _run(route, 24, local, max_concurrency=1, checkpoint_interval=8)

    assert "'score' as String" in str(raised.value)
    stored = _stored(local)
    assert stored.height >= 12  # the rows before the change are kept
    assert stored.schema["score"] == pl.Int64


def test_a_per_row_function_takes_no_batch_size(local: Storage) -> None:
    with pytest.raises(CheckpointError, match="batch_size=4"):
        _run(Routes(asynchronous=False).fn, 4, local, batch_size=4)
