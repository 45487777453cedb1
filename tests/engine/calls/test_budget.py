"""Spend budgets in the engine: a run stops starting calls at its limit, keeps what it paid for,
overshoots by at most the calls in flight, and the reservation API the provider-batch path uses."""

from __future__ import annotations

import threading
import time
from typing import Any

import polars as pl
import pytest
from helpers.rows import engine_settings, tickets

from checkpoint_assets.engine import (
    Checkpoint,
    PerRow,
    RunContext,
    Settings,
    open_store,
    prepare,
    run,
)
from checkpoint_assets.engine.calls.batches import RowResult
from checkpoint_assets.engine.calls.budget import Budget, Price, Spend
from checkpoint_assets.engine.errors import BudgetExceededError, CheckpointError

ID = "ticket_id"
# 1,000 input and 500 output tokens per row at 1 and 2 USD per million: 0.002 USD a row.
PRICES = {"small": Price(input=1.0, output=2.0)}
ROW_USD = 0.002


class Priced:
    """A per-row function that answers with fixed token counts and counts its calls."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls = 0
        self.delay = delay
        self._lock = threading.Lock()

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.calls += 1
        time.sleep(self.delay)
        return {"route": "billing", "input_tokens": 1000, "output_tokens": 500}


def _settings(budget: Budget, **kw: Any) -> Settings:
    base: dict[str, Any] = {
        "input_columns": ("subject", "body"),
        "checkpoint_interval": 4,
        "usage_columns": ("input_tokens", "output_tokens"),
        "budget": budget,
    }
    return engine_settings(**(base | kw))


def _run(fn: Priced, n: int, tmp_path: Any, budget: Budget, **kw: Any) -> Any:
    s = _settings(budget, **kw)
    checkpoint = Checkpoint(open_store(str(tmp_path / "checkpoints")), "job")
    return run(PerRow(fn), prepare(tickets(n), s), checkpoint, s, job={"test": 1})


def _stored(tmp_path: Any) -> pl.DataFrame:
    return Checkpoint(open_store(str(tmp_path / "checkpoints")), "job").load(ID).rows


def test_a_run_stops_starting_calls_at_its_limit_and_keeps_what_it_paid_for(
    tmp_path: Any,
) -> None:
    fn = Priced()
    budget = Budget(PRICES, max_run_cost=10 * ROW_USD)
    with pytest.raises(BudgetExceededError) as stopped:
        _run(fn, 50, tmp_path, budget)
    # One call at a time: the tenth call reaches the limit, and no other starts.
    assert fn.calls == 10
    assert _stored(tmp_path).height == 10
    text = str(stopped.value)
    assert "max_run_cost is 0.0200 USD" in text and "has spent 0.0200 USD" in text
    assert "Raise max_run_cost" in text
    # Raising the limit goes on from the stored rows: only the rest is paid for.
    _, stats = _run(fn, 50, tmp_path, Budget(PRICES, max_run_cost=1.0))
    assert fn.calls == 50 and stats.rows_resumed == 10
    assert stats.cost_usd == pytest.approx(40 * ROW_USD)
    assert stats.cost_by_model == {"small": pytest.approx(40 * ROW_USD)}


@pytest.mark.parametrize("concurrency", [4, 8])
def test_calls_in_flight_at_the_limit_are_the_most_it_overshoots(
    tmp_path: Any, concurrency: int
) -> None:
    fn = Priced(delay=0.01)
    budget = Budget(PRICES, max_run_cost=10 * ROW_USD)
    with pytest.raises(BudgetExceededError) as stopped:
        _run(fn, 200, tmp_path, budget, max_concurrency=concurrency, adaptive_concurrency=False)
    # Every call paid for is stored; the tenth result reached the limit, and at most the other
    # calls in flight then (max_concurrency - 1) were paid beyond it.
    assert _stored(tmp_path).height == fn.calls
    assert 10 <= fn.calls <= 10 + concurrency - 1
    assert stopped.value.spent == pytest.approx(fn.calls * ROW_USD)
    assert stopped.value.spent <= budget.max_run_cost + concurrency * ROW_USD  # type: ignore[operator]


def test_a_limit_already_spent_starts_no_call(tmp_path: Any) -> None:
    fn = Priced()
    budget = Budget(PRICES, max_asset_cost=1.0)
    s = _settings(budget)
    checkpoint = Checkpoint(open_store(str(tmp_path / "checkpoints")), "job")
    spend = Spend(budget, asset_spent_before=1.5, label="tickets")
    with pytest.raises(BudgetExceededError, match=r"max_asset_cost is 1\.0000 USD"):
        run(
            PerRow(fn),
            prepare(tickets(8), s),
            checkpoint,
            s,
            job={"t": 1},
            context=RunContext(spend=spend),
        )
    assert fn.calls == 0


def test_a_run_that_finishes_at_the_limit_succeeds(tmp_path: Any) -> None:
    result, stats = _run(Priced(), 10, tmp_path, Budget(PRICES, max_run_cost=10 * ROW_USD))
    assert result.height == 10 and stats.cost_usd == pytest.approx(10 * ROW_USD)


def test_rows_are_priced_by_their_model_column(tmp_path: Any) -> None:
    budget = Budget({"small": Price(1.0, 2.0), "large": Price(10.0, 20.0)}, model_column="model")

    def two_models(batch: pl.DataFrame) -> pl.DataFrame:
        large = batch.get_column(ID) % 2 == 0
        return batch.select(
            ID,
            model=pl.when(large).then(pl.lit("large")).otherwise(pl.lit("small")),
            input_tokens=pl.lit(1000),
            output_tokens=pl.lit(500),
        )

    s = _settings(budget)
    checkpoint = Checkpoint(open_store(str(tmp_path / "checkpoints")), "job")
    _, stats = run(two_models, prepare(tickets(10), s), checkpoint, s, job={"t": 1})
    assert stats.cost_by_model == {
        "small": pytest.approx(5 * 0.002),
        "large": pytest.approx(5 * 0.02),
    }
    assert stats.cost_usd == pytest.approx(5 * 0.002 + 5 * 0.02)


def test_a_model_without_a_price_stops_the_run_and_keeps_its_rows(tmp_path: Any) -> None:
    budget = Budget({"small": Price(1.0, 2.0), "large": Price(3.0, 4.0)}, model_column="model")

    def unknown(row: dict[str, Any]) -> dict[str, Any]:
        return {"model": "mystery", "input_tokens": 1, "output_tokens": 1}

    s = _settings(budget, max_concurrency=1)
    checkpoint = Checkpoint(open_store(str(tmp_path / "checkpoints")), "job")
    with pytest.raises(CheckpointError, match=r"'mystery'.*has no price"):
        run(PerRow(unknown), prepare(tickets(10), s), checkpoint, s, job={"t": 1})
    assert _stored(tmp_path).height == 1  # the one call paid for is kept


def test_budget_and_settings_refuse_what_cannot_be_priced() -> None:
    with pytest.raises(ValueError, match="needs model_column"):
        Budget({"a": Price(1, 1), "b": Price(1, 1)})
    with pytest.raises(ValueError, match="batch_discount"):
        Price(1, 1, batch_discount=1.0)
    with pytest.raises(ValueError, match="add them to usage_columns"):
        Settings(ID, usage_columns=("input_tokens",), budget=Budget(PRICES))


def test_a_submission_reserves_its_estimate_and_its_results_count_at_the_batch_price() -> None:
    budget = Budget(PRICES, max_run_cost=1.0)
    spend = Spend(budget, label="tickets 0-of-2")
    estimate = budget.cost("small", 200_000, 200_000, batch=True)  # 0.3 USD at half price
    assert estimate == pytest.approx(0.3)
    for _ in range(3):
        spend.reserve(estimate, "small")
    with pytest.raises(BudgetExceededError, match=r"max_run_cost is 1\.0000 USD"):
        spend.reserve(estimate, "small")  # 0.9 held: a fourth would pass the limit
    assert spend.reserved == pytest.approx(0.9)  # a refused reservation holds nothing
    assert not spend.stopped
    # The results cost more than estimated: 0.8 USD at the per-row price, 0.4 at the batch one.
    result = RowResult({"input_tokens": 400_000, "output_tokens": 200_000}, 1, 0, 1)
    spend.add_record(result, batch=True)
    spend.release(estimate)
    assert spend.spent == pytest.approx(0.4) and spend.reserved == pytest.approx(0.6)
    assert spend.stopped  # 1.0 spent or held: no per-row call starts any more


def test_a_result_without_its_model_says_which_column_to_return(tmp_path: Any) -> None:
    budget = Budget({"small": Price(1.0, 2.0), "large": Price(3.0, 4.0)}, model_column="model")

    def no_model(batch: pl.DataFrame) -> pl.DataFrame:
        return batch.select(ID, input_tokens=pl.lit(1), output_tokens=pl.lit(1))

    s = _settings(budget)
    checkpoint = Checkpoint(open_store(str(tmp_path / "checkpoints")), "job")
    with pytest.raises(CheckpointError, match="in the output column 'model' of every row"):
        run(no_model, prepare(tickets(10), s), checkpoint, s, job={"t": 1})
    assert _stored(tmp_path).height == 4  # the one call paid for is kept
