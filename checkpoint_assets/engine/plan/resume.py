"""Resume: compare the input with what a checkpoint holds and decide what is left to do.

Everything is by id, never by position, and vectorised. The stored ids are a polars column,
joined against the input's, so 10**8 finished ids need no Python objects per row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl

from checkpoint_assets.engine.errors import InputChangedError, InvalidIdsError
from checkpoint_assets.engine.rows import ATTEMPTS, ERROR, INPUT_HASH, distinct_count
from checkpoint_assets.engine.settings import OnInputChange

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FIT_INT64 = (pl.Int8, pl.Int16, pl.Int32, pl.Int64, pl.UInt8, pl.UInt16, pl.UInt32)


# A row's position in the source as its producer returned it, counted from 0. It is set when
# ``df`` holds other rows or another order (a shard's rows, a stored source ordered by shard key).
# Null where unknown. Without it, positions are ``df``'s own.
SOURCE_ROW = "_source_row"
# The hash of a row's input columns (its id left out), when the run dedupes: equal inputs share it.
DEDUPE_KEY = "__dedupe_key"


def validate_ids(df: pl.DataFrame, id_column: str) -> None:
    """Refuse ids that cannot identify rows, before any call of the user's function.

    Null and duplicated ids are reported with their rows in the source (``SOURCE_ROW``).
    """
    if id_column not in df.columns:
        raise InvalidIdsError(id_column, f"is not in the input (columns: {df.columns})")
    ids = df.get_column(id_column)
    if not (ids.dtype.is_integer() or ids.dtype == pl.String):
        raise InvalidIdsError(
            id_column,
            f"has type {ids.dtype}; ids must be integers or strings (cast it, or derive a "
            "stable string id, in the source asset)",
            ids.head(5).to_list(),
        )
    if ids.dtype.is_integer() and ids.dtype not in _FIT_INT64:
        # Integer ids are stored as Int64: a wider value would fail, or wrap, later on.
        too_big = ids > _INT64_MAX
        wide = ids.filter(
            too_big if ids.dtype.is_unsigned_integer() else too_big | (ids < _INT64_MIN)
        )
        if wide.len():
            raise InvalidIdsError(
                id_column,
                f"({ids.dtype}) has {wide.len()} value(s) outside the range of Int64; integer "
                "ids are stored as Int64: cast them to string in the source asset "
                "(pl.col(...).cast(pl.String)) to keep them exact",
                wide.head(5).to_list(),
            )
    nulls = ids.null_count()
    if nulls:
        rows = _rows(df, pl.col(id_column).is_null())
        raise InvalidIdsError(id_column, f"has {nulls} null value(s), at {rows} ({_FROM_0})")
    if distinct_count(ids) != ids.len():
        dupes = ids.filter(ids.is_duplicated()).unique(maintain_order=True)
        where = "; ".join(
            f"{value!r} at {_rows(df, pl.col(id_column) == value)}"
            for value in dupes.head(3).to_list()
        )
        raise InvalidIdsError(
            id_column,
            f"has {dupes.len()} duplicated value(s) ({where}; {_FROM_0}); results are stored "
            "and resumed by id",
            dupes.head(5).to_list(),
        )


_FROM_0 = "its first row is row 0"


def _rows(df: pl.DataFrame, which: pl.Expr) -> str:
    """The rows ``which`` selects, in words: their first positions in the source
    (``SOURCE_ROW``, else ``df``'s own)."""
    if SOURCE_ROW in df.columns:
        found = df.filter(which).get_column(SOURCE_ROW).sort()
        if found.null_count():
            return "rows the stored source did not record (materialize it again to see them)"
    else:
        found = df.with_row_index("__row").filter(which).get_column("__row")
    more = ", ..." if found.len() > 5 else ""
    return f"rows [{', '.join(str(r) for r in found.head(5).to_list())}{more}] of the source"


def canonical_ids(frame: pl.DataFrame, id_column: str) -> pl.DataFrame:
    """``frame`` with its (validated) ids as stored: integers of any width as Int64."""
    if frame.schema[id_column].is_integer():
        return frame.with_columns(pl.col(id_column).cast(pl.Int64))
    return frame


@dataclass
class Plan:
    """What a run does: the rows to compute and what it takes from the checkpoint."""

    todo: pl.DataFrame  # input rows to compute, with ``_input_hash`` and prior ``_attempts``
    resumed: int  # finished rows taken from the checkpoint
    kept_failed: int  # stored failures kept as they are (retry_failed off)
    changed: int  # finished rows whose input changed (recomputed)
    dropped: int  # stored rows whose id is no longer in the input
    total: int
    # stored rows whose format-1 hash cannot tell whether their input changed (NaN, infinities
    # and null inside nested values): recomputed, not counted as changed
    rehashed: int = 0


def plan(
    inputs: pl.DataFrame,
    stored: pl.DataFrame,
    id_column: str,
    *,
    resume: bool,
    retry_failed: bool,
    on_input_change: OnInputChange,
    earlier_hashes: Callable[[pl.DataFrame], np.ndarray] | None = None,
) -> Plan:
    """Split ``inputs`` (the keys of the input rows: id and ``_input_hash``) into rows to
    compute and rows already done.

    ``earlier_hashes``: the hash format 1 of some of ``inputs``' rows, when the stored hashes
    may be of that format. Format 1 wrote NaN, infinities and null inside nested values alike.
    So a stored row whose hash differs from its input's but equals its format-1 hash may or may
    not have another input. It is recomputed, and counted in ``rehashed``, not as changed.
    """
    total = inputs.height
    if not resume or stored.height == 0:
        todo = inputs.with_columns(pl.lit(0, pl.Int32).alias(ATTEMPTS))
        return Plan(todo, 0, 0, 0, _count_dropped(inputs, stored, id_column), total)
    joined = _joined(inputs, stored, id_column)
    counts = joined.select(
        _FOUND.sum().alias("found"),
        (_FOUND & ~_SAME).sum().alias("changed"),
        _DONE.sum().alias("done"),
        _FAILED.sum().alias("failed"),
    ).row(0, named=True)
    changed = joined.filter(_FOUND & ~_SAME) if counts["changed"] else joined.clear()
    changed, rehashed = _unclear_left_out(changed, earlier_hashes)
    if changed.height and on_input_change == OnInputChange.fail:
        sample = changed.get_column(id_column).head(5).to_list()
        raise InputChangedError(changed.height, total, sample)
    resumed = int(counts["done"])
    kept_failed = 0 if retry_failed else int(counts["failed"])
    dropped = stored.height - int(counts["found"])  # ids are unique on both sides
    if resumed + kept_failed == total:  # nothing left to do: skip filtering every row
        todo = inputs.clear().with_columns(pl.lit(0, pl.Int32).alias(ATTEMPTS))
    else:
        todo = _todo(joined, retry_failed)
    return Plan(todo, resumed, kept_failed, changed.height, dropped, total, rehashed)


# Over ``_joined``'s frame: whether a row is stored, with the same input, done or failed.
_FOUND = pl.col("__ok").is_not_null()
_SAME = pl.col("__stored_hash") == pl.col(INPUT_HASH)
_DONE = _FOUND & _SAME & pl.col("__ok")
_FAILED = _FOUND & _SAME & ~pl.col("__ok")


def _joined(inputs: pl.DataFrame, stored: pl.DataFrame, id_column: str) -> pl.DataFrame:
    """``inputs`` with what ``stored`` holds of each row: its input hash, whether it is done,
    its calls so far (nulls where it holds none)."""
    prior = stored.select(
        id_column,
        pl.col(INPUT_HASH).alias("__stored_hash"),
        pl.col(ERROR).is_null().alias("__ok"),
        pl.col(ATTEMPTS).alias("__attempts"),
    )
    return inputs.hstack(_align(inputs.get_column(id_column), prior, id_column))


def _unclear_left_out(
    changed: pl.DataFrame, earlier_hashes: Callable[[pl.DataFrame], np.ndarray] | None
) -> tuple[pl.DataFrame, int]:
    """The ``changed`` rows whose input did change, and how many of them may not have: their
    stored hash is their input's format-1 hash (see ``plan``)."""
    if not changed.height or earlier_hashes is None:
        return changed, 0
    unclear = changed.get_column("__stored_hash").to_numpy() == earlier_hashes(changed)
    return changed.filter(pl.Series(~unclear)), int(unclear.sum())


def _todo(joined: pl.DataFrame, retry_failed: bool) -> pl.DataFrame:
    """The rows of ``joined`` to compute, with their calls so far (0 if their input changed)."""
    keep_out = _DONE if retry_failed else _DONE | _FAILED
    return (
        joined.filter(~keep_out.fill_null(False))
        .with_columns(
            pl.when(_SAME)
            .then(pl.col("__attempts"))
            .otherwise(0)
            .fill_null(0)
            .cast(pl.Int32)
            .alias(ATTEMPTS)
        )
        .drop("__stored_hash", "__ok", "__attempts")
    )


def _align(ids: pl.Series, prior: pl.DataFrame, id_column: str) -> pl.DataFrame:
    """``prior``'s other columns for each of ``ids``, in their order (nulls where absent).

    Both sides have unique ids. The common cases skip the hash join, which costs seconds at
    10**7 rows:

    - a checkpoint stored in the input's order (a finished run) is used as it is;
    - two id-sorted sides are matched with a linear sorted merge (``join_asof``).
    """
    stored_ids = prior.get_column(id_column)
    if stored_ids.dtype == ids.dtype and stored_ids.equals(ids):
        return prior.drop(id_column)
    if stored_ids.dtype == ids.dtype and ids.is_sorted() and stored_ids.is_sorted():
        keyed = ids.to_frame(id_column).set_sorted(id_column)
        candidates = prior.with_columns(pl.col(id_column).alias("__id")).set_sorted(id_column)
        matched = keyed.join_asof(candidates, on=id_column, strategy="backward")
        hit = pl.col("__id") == pl.col(id_column)
        columns = [c for c in prior.columns if c != id_column]
        return matched.select(pl.when(hit).then(pl.col(c)).alias(c) for c in columns)
    keyed = ids.to_frame(id_column)
    return keyed.join(prior, on=id_column, how="left", maintain_order="left").drop(id_column)


def _count_dropped(inputs: pl.DataFrame, stored: pl.DataFrame, id_column: str) -> int:
    if stored.height == 0:
        return 0
    return stored.join(inputs.select(id_column), on=id_column, how="anti").height


@dataclass
class Copies:
    """Rows whose input duplicates an earlier row's (``dedupe``): they take its result."""

    rows: pl.DataFrame  # id, "__rep" (the id computed instead), _input_hash, _attempts

    def of(self, computed: pl.DataFrame, id_column: str) -> pl.DataFrame:
        """The copies of the ``computed`` rows, with their representative's outputs and error."""
        values = computed.drop(INPUT_HASH, ATTEMPTS).rename({id_column: "__rep"})
        return (
            self.rows.join(values, on="__rep", how="inner")
            .drop("__rep")
            .with_columns(pl.col(ATTEMPTS).cast(pl.Int32))
        )


def dedupe(todo: pl.DataFrame, id_column: str) -> tuple[pl.DataFrame, Copies]:
    """The rows to compute (one per distinct input, by ``DEDUPE_KEY``) and the copies that take
    their results."""
    reps = todo.unique(subset=[DEDUPE_KEY], keep="first", maintain_order=True)
    copies = (
        todo.join(reps.select(pl.col(id_column).alias("__rep"), DEDUPE_KEY), on=DEDUPE_KEY)
        .filter(pl.col(id_column) != pl.col("__rep"))
        .select(id_column, "__rep", INPUT_HASH, ATTEMPTS)
    )
    return reps, Copies(copies)
