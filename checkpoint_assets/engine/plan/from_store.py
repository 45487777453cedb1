"""Rows a run takes from the result store instead of computing them (``engine/reuse/``).

Asked after resume and before dedupe, before any call: of the rows left to compute, those whose
content key the store holds in the run's scope take their stored outputs. They keep their own id
and input hash, with no error and no attempts; ``opening.py`` writes them into the checkpoint as
one part, like computed rows, and leaves them out of what is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from checkpoint_assets.engine.calls.batches import FrameResult
from checkpoint_assets.engine.calls.budget import Budget
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.plan.inputs import CONTENT_LO
from checkpoint_assets.engine.plan.resume import DEDUPE_KEY
from checkpoint_assets.engine.reuse.layout import ID_KEY, KEYS, id_key, stored_keys
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.rows import ATTEMPTS, ERROR, INPUT_HASH


@dataclass(frozen=True)
class Taken:
    """Rows found in the store: as stored rows (``_seq`` to be set), and what they cost when
    they were computed (with a budget; None: no budget, or a model it does not price)."""

    rows: pl.DataFrame
    cost_saved: float | None


def take(
    todo: pl.DataFrame,
    results: ResultStore,
    scope: str,
    id_column: str,
    budget: Budget | None,
) -> Taken | None:
    """The rows of ``todo`` (rows of a shard's keys, with their content key) that the store
    holds, or None when it holds none."""
    if not todo.height or CONTENT_LO not in todo.columns:
        return None
    keyed = todo.select(
        id_column,
        INPUT_HASH,
        *stored_keys(DEDUPE_KEY, CONTENT_LO),
        id_key(id_column, todo.schema[id_column]),
    )
    found = results.lookup(scope, keyed.select(*KEYS, ID_KEY))
    if not found.height:
        return None
    outputs = [c for c in found.columns if c not in KEYS]
    rows = keyed.join(found, on=list(KEYS), how="inner", maintain_order="left").select(
        id_column,
        *outputs,
        pl.lit(None, pl.String).alias(ERROR),
        pl.lit(0, pl.Int32).alias(ATTEMPTS),
        INPUT_HASH,
    )
    return Taken(rows, _cost(rows.select(outputs), budget))


def _cost(outputs: pl.DataFrame, budget: Budget | None) -> float | None:
    """What ``outputs`` cost when computed, at the budget's prices."""
    if budget is None:
        return None
    try:
        costs = budget.cost_of(FrameResult(outputs, outputs.clear(), 0))
    except CheckpointError:
        return None
    return sum(costs.values()) if costs else None
