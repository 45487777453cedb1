"""Spend budgets: what calls cost, and the limit that stops new ones.

A :class:`Budget` names:

- a price per model: USD per million input and output tokens, and the discount of the
  provider's batch API;
- the two ``usage_columns`` that count a row's tokens;
- the limits: ``max_run_cost`` (one run, all its shards) and ``max_asset_cost`` (the asset,
  every shard and run). The Dagster layer reads what was spent before from the instance.

A row's cost::

    (input_tokens * price.input + output_tokens * price.output) / 1e6   (x (1 - batch_discount)
                                                                         through a batch API)

at the price of its model: the value of ``model_column`` in the row, or the table's one model.

:class:`Spend` is what a run has spent, shared by its workers. The limit is checked where calls
are admitted (``caller.Caller``). A call starts only while the spend is under every limit, and its
cost is added when it returns. Calls admitted before the limit was reached still finish and are
stored. So the spend passes the limit by at most the cost of the calls in flight when it was
reached: ``max_concurrency`` calls, the one that reached it included.

A provider batch submission costs what its results will say. Before it is created, that cost is
known only as an estimate. So the estimate is reserved before the submission is created. When
the results are in, the reservation is replaced by what they cost at the batch price
(``provider_batches.py``)::

    cost = budget.cost(model, input_tokens=n_in, output_tokens=n_out_max, batch=True)
    spend.reserve(cost, model)   # BudgetExceededError if it does not fit: submit nothing
    ...                          # create the submission; later, download its results
    spend.add_record(result, batch=True)  # each row's result, at the batch price
    spend.release(cost)          # the reservation is gone: the results count instead

>>> budget = Budget({"small": Price(input=0.15, output=0.60)}, max_run_cost=1.0)
>>> spend = Spend(budget)
>>> spend.add(budget.cost("small", input_tokens=2_000_000, output_tokens=1_000_000), "small")
>>> round(spend.spent, 2), spend.reached()
(0.9, None)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls.batches import Record, RowResult
from checkpoint_assets.engine.errors import BudgetExceededError, CheckpointError
from checkpoint_assets.engine.fields import required, setting

PER = 1_000_000  # prices are per million tokens
EPSILON = 1e-9  # USD: sums of floats that should meet a limit may miss it by rounding


@dataclass(frozen=True)
class Price:
    """One model's price in USD per million tokens, and the fraction off through the
    provider's batch API."""

    input: float = required("USD per million input tokens.")
    output: float = required("USD per million output tokens.")
    batch_discount: float = setting(
        0.5, "Fraction off through the provider's batch API (0.5 at OpenAI and Anthropic)."
    )

    def __post_init__(self) -> None:
        if (
            not (math.isfinite(self.input) and math.isfinite(self.output))
            or min(self.input, self.output) < 0
        ):
            raise ValueError(f"prices must be 0 or more USD per million tokens, got {self}")
        if not 0.0 <= self.batch_discount < 1.0:
            raise ValueError(f"batch_discount must be in [0, 1), got {self.batch_discount}")


@dataclass(frozen=True)
class Budget:
    """Prices per model, the usage columns they apply to, and the spend limits (None: none).

    ``prices`` maps a model name to a :class:`Price` (or a dict of its fields). Without
    ``model_column`` every row is priced as the table's one model.
    """

    prices: Mapping[str, Price] = required("Price per model name.")
    input_tokens: str = setting("input_tokens", "The usage column counting input tokens.")
    output_tokens: str = setting("output_tokens", "The usage column counting output tokens.")
    model_column: str | None = setting(
        None, "The output column naming each row's model (default: the one model priced)."
    )
    max_run_cost: float | None = setting(None, "USD one run may spend, all its shards.")
    max_asset_cost: float | None = setting(
        None, "USD the asset may have spent, every shard and run."
    )

    def __post_init__(self) -> None:
        prices = {str(m): p if isinstance(p, Price) else Price(**p) for m, p in self.prices.items()}
        object.__setattr__(self, "prices", prices)
        if not prices:
            raise ValueError("a Budget needs the price of at least one model in prices")
        if self.model_column is None and len(prices) > 1:
            raise ValueError(
                f"a Budget with several models ({sorted(prices)}) needs model_column: the output "
                "column that names each row's model"
            )
        for name in LIMITS:
            check_limit(name, getattr(self, name))

    @property
    def columns(self) -> tuple[str, ...]:
        """The usage columns the prices read."""
        return (self.input_tokens, self.output_tokens)

    def price(self, model: str | None) -> Price:
        """The price of ``model`` (None: the table's one model); raises when it has none."""
        if self.model_column is None:
            return next(iter(self.prices.values()))
        if model is None:
            raise CheckpointError(
                f"A result has no model in the budget's model_column {self.model_column!r}, so "
                "what it cost is unknown.",
                f"Return the model's name in the output column {self.model_column!r} of every "
                "row; the rows done so far are kept.",
            )
        found = self.prices.get(str(model))
        if found is None:
            raise CheckpointError(
                f"The model {model!r} (column {self.model_column!r}) has no price in the "
                f"budget (priced: {sorted(self.prices)}), so what it costs is unknown.",
                "Add its price to the budget's prices; the rows done so far are kept.",
            )
        return found

    def cost(
        self, model: str | None, input_tokens: float, output_tokens: float, *, batch: bool = False
    ) -> float:
        """USD for these tokens of ``model``; ``batch``: through the provider's batch API."""
        price = self.price(model)
        usd = (input_tokens * price.input + output_tokens * price.output) / PER
        return usd * (1.0 - price.batch_discount) if batch else usd

    def cost_of(self, record: Record, *, batch: bool = False) -> dict[str | None, float]:
        """USD of the rows of one call's result, by model; ``batch``: at the batch price."""
        if isinstance(record, RowResult):
            out = record.out
            model = out.get(self.model_column) if self.model_column else None
            tokens = _number(out.get(self.input_tokens)), _number(out.get(self.output_tokens))
            return {model: self.cost(model, *tokens, batch=batch)}
        frame = record.out
        if any(c not in frame.columns for c in self.columns):
            return {}  # the run loop refuses the result (usage_columns); nothing to price
        if self.model_column is None or self.model_column not in frame.columns:
            sums = [_number(frame.get_column(c).sum()) for c in self.columns]
            return {None: self.cost(None, *sums, batch=batch)}
        grouped = frame.group_by(self.model_column).agg(pl.col(c).sum() for c in self.columns)
        return {
            model: self.cost(model, _number(i), _number(o), batch=batch)
            for model, i, o in grouped.iter_rows()
        }


LIMITS = ("max_run_cost", "max_asset_cost")  # the spend limits among the fields of a Budget


def check_limit(name: str, value: float | None) -> None:
    """Refuse a spend limit below 0 USD (None: no limit)."""
    if value is not None and not value >= 0:
        raise ValueError(f"{name} must be 0 or more USD, got {value}")


def _number(value: Any) -> float:
    """A token count (None and non-numbers count 0: the run loop refuses a non-numeric column)."""
    return float(value) if isinstance(value, int | float) else 0.0


@dataclass(frozen=True)
class Limit:
    """A spend limit that was reached: which, its value, and what was spent against it."""

    name: str  # "max_run_cost" or "max_asset_cost"
    limit: float
    spent: float


@dataclass
class Spend:
    """What a run has spent (USD), against the budget's limits; safe to share between threads.

    ``asset_spent_before``: what the asset spent before this run (every shard, every run), which
    ``max_asset_cost`` counts too.
    """

    budget: Budget
    asset_spent_before: float = 0.0
    label: str = "budget"  # the run's, for messages
    spent: float = 0.0
    by_model: dict[str, float] = field(default_factory=dict)
    problem: CheckpointError | None = None  # a result that could not be priced
    reserved: float = 0.0
    # Brings ``asset_spent_before`` up to date (others' spend while this run goes on), called by
    # the run loop at most every ``refresh_seconds``.
    refresh: Callable[[], None] | None = None
    refresh_seconds: float = 30.0
    _refreshed: float = field(default_factory=time.monotonic, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def maybe_refresh(self) -> None:
        """Call ``refresh`` when ``refresh_seconds`` have passed since the last time."""
        now = time.monotonic()
        if self.refresh is not None and now - self._refreshed >= self.refresh_seconds:
            self._refreshed = now
            self.refresh()

    def reached(self) -> Limit | None:
        """The first limit the spend (reservations included) has reached, or None."""
        return next((x for x in self._limits(0.0) if x.spent >= x.limit - EPSILON), None)

    def _limits(self, adding: float) -> list[Limit]:
        spent = self.spent + self.reserved + adding
        run, asset = self.budget.max_run_cost, self.budget.max_asset_cost
        limits = [] if run is None else [Limit("max_run_cost", run, spent)]
        if asset is not None:
            limits.append(Limit("max_asset_cost", asset, self.asset_spent_before + spent))
        return limits

    @property
    def stopped(self) -> bool:
        """No new call may start: a limit is reached, or a result could not be priced.

        :meth:`reached` without building its answer: this is asked several times per call."""
        spent = self.spent + self.reserved + EPSILON  # reached when within EPSILON below
        run, asset = self.budget.max_run_cost, self.budget.max_asset_cost
        return (
            self.problem is not None
            or (run is not None and spent >= run)
            or (asset is not None and self.asset_spent_before + spent >= asset)
        )

    def add(self, usd: float, model: str | None = None) -> None:
        """Count a call's cost."""
        name = self._name(model)
        with self._lock:
            self.spent += usd
            self.by_model[name] = self.by_model.get(name, 0.0) + usd

    def add_record(self, record: Record, *, batch: bool = False) -> None:
        """Count what one call's result cost (see :meth:`Budget.cost_of`); ``batch``: a result
        of a provider's batch API, at the batch price."""
        try:
            costs = self.budget.cost_of(record, batch=batch)
        except CheckpointError as e:
            self.problem = self.problem or e
            return
        for model, usd in costs.items():
            self.add(usd, model)

    def reserve(self, usd: float, model: str | None = None) -> None:
        """Hold ``usd`` (a submission's estimate) against the limits, or raise
        :class:`BudgetExceededError` without holding anything when it does not fit."""
        with self._lock:
            over = next((x for x in self._limits(usd) if x.spent > x.limit + EPSILON), None)
            if over is not None:
                raise BudgetExceededError(self.label, over.name, over.limit, over.spent, 0)
            self.reserved += usd

    def release(self, reserved: float) -> None:
        """Drop a reservation (its submission's results are counted, or never will be)."""
        with self._lock:
            self.reserved -= reserved

    def _name(self, model: str | None) -> str:
        """The model's name in ``by_model`` (None: the table's one model)."""
        return next(iter(self.budget.prices)) if model is None else str(model)
