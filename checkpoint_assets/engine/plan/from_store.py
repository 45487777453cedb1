"""Rows a run takes from the result store instead of computing them (``engine/reuse/``).

Asked after resume and before dedupe, before any call: of the rows left to compute, those whose
content key the store holds in the run's scope take their stored outputs. They keep their own id
and input hash, with no error and no attempts; ``found.py`` writes them into the checkpoint as
one part, like computed rows, and leaves them out of what is computed. A dry run counts them
(``estimate.py``): ``held`` reads the store and writes nothing.

A request/parse job that keeps its answers (``Job.parse``) has the request part of its
fingerprint as its scope, so a changed ``parse`` does not miss. It takes only rows stored with
an answer, and their outputs are that answer parsed by the current ``parse`` (``reparse.py``):
a ``parse`` that raises makes the row failed with its text.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from checkpoint_assets.engine.calls.batches import FrameResult
from checkpoint_assets.engine.calls.budget import Budget
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.plan import reparse
from checkpoint_assets.engine.plan.inputs import CONTENT_LO
from checkpoint_assets.engine.plan.reparse import Parse
from checkpoint_assets.engine.plan.resume import DEDUPE_KEY
from checkpoint_assets.engine.reuse.layout import ID_KEY, KEYS, id_key, stored_keys
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.rows import ANSWER, ATTEMPTS, ERROR, INPUT_HASH, outputs_of


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
    *,
    parse: Parse | None = None,
    label: str = "",
) -> Taken | None:
    """The rows of ``todo`` (rows of a shard's keys, with their content key) that the store
    holds, or None when it holds none. ``parse``: their outputs are their answers parsed again
    (see the module docstring)."""
    rows = held(todo, results, scope, id_column, answered=parse is not None)
    if rows is None:
        return None
    if parse is not None:
        rows = reparse.stored_rows(rows, parse, id_column, label)
    ok = rows.filter(pl.col(ERROR).is_null())
    return Taken(rows, _cost(ok.select(outputs_of(ok, id_column)), budget))


def held(
    todo: pl.DataFrame, results: ResultStore, scope: str, id_column: str, *, answered: bool
) -> pl.DataFrame | None:
    """The rows of ``todo`` that the store holds, as stored rows with their stored outputs (and
    ``_answer``), or None when it holds none. ``answered``: only those with an answer."""
    if not todo.height or CONTENT_LO not in todo.columns:
        return None
    keyed = todo.select(
        id_column,
        INPUT_HASH,
        *stored_keys(DEDUPE_KEY, CONTENT_LO),
        id_key(id_column, todo.schema[id_column]),
    )
    found = results.lookup(scope, keyed.select(*KEYS, ID_KEY))
    if answered:
        has = pl.col(ANSWER).is_not_null() if ANSWER in found.columns else pl.lit(False)
        found = found.filter(has)
    if not found.height:
        return None
    outputs = [c for c in found.columns if c not in KEYS]
    return keyed.join(found, on=list(KEYS), how="inner", maintain_order="left").select(
        id_column,
        *outputs,
        pl.lit(None, pl.String).alias(ERROR),
        pl.lit(0, pl.Int32).alias(ATTEMPTS),
        INPUT_HASH,
    )


def fits(rows: pl.DataFrame, known: dict[str, str] | None, id_column: str) -> bool:
    """Whether the output columns of ``rows`` are those the checkpoint holds (``known``: its
    meta's output schema; None: it holds none yet)."""
    return not known or sorted(known) == sorted(outputs_of(rows, id_column))


def _cost(outputs: pl.DataFrame, budget: Budget | None) -> float | None:
    """What ``outputs`` cost when computed, at the budget's prices."""
    if budget is None:
        return None
    try:
        costs = budget.cost_of(FrameResult(outputs, outputs.clear(), 0))
    except CheckpointError:
        return None
    return sum(costs.values()) if costs else None
