"""Stored rows: the bookkeeping columns every stored row carries, and which row of an id wins.

Every stored row carries the id, the output columns and these columns:

- ``_error``: null on success, the error's text on failure;
- ``_attempts``: calls that included the row so far;
- ``_input_hash``: the 64-bit hash of the row's id and input columns (see ``hashing.py``);
- ``_seq``: the flush that wrote it;
- ``_current`` (merged file only): false for rows absent from the input at the last finalize;
  they are kept, never lost, but are not part of the result;
- ``_answer`` (request/parse jobs only): the provider's response body of the row, as compact
  JSON text, so a changed ``parse`` re-derives the outputs with no call
  (``providers/answers.py``). Null where none was kept.

Which of several stored rows of one id wins:

- the input hash of the id's newest row is the id's current input;
- among the rows with that hash, a success beats a failure, then the newest wins.

When the input never changes, this is exactly "success beats failure, then newest".
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from checkpoint_assets.engine.errors import CorruptCheckpointError

ERROR = "_error"
ATTEMPTS = "_attempts"
INPUT_HASH = "_input_hash"
SEQ = "_seq"
CURRENT = "_current"
ANSWER = "_answer"
BOOKKEEPING = (ERROR, ATTEMPTS, INPUT_HASH, SEQ, CURRENT, ANSWER)
# The ``_error`` of an input row the function returned no row for. The end of a run tells these
# apart: they are a bug in the function, not a failure of the row.
NO_RESULT = "the function returned no result for this row"


def empty(id_column: str) -> pl.DataFrame:
    """No stored rows (an empty shard, an outage on the first call), with an id column."""
    return pl.DataFrame(
        schema={ERROR: pl.String, ATTEMPTS: pl.Int32, INPUT_HASH: pl.UInt64, SEQ: pl.Int64}
    ).with_columns(pl.lit(None).alias(id_column))


def outputs_of(rows: pl.DataFrame, id_column: str) -> list[str]:
    """The output columns of stored or returned rows: everything but the id and bookkeeping."""
    return [c for c in rows.columns if c != id_column and c not in BOOKKEEPING]


def stamped(rows: pl.DataFrame, seq: int) -> pl.DataFrame:
    """``rows`` with the ``_seq`` of the flush that stores them."""
    return rows.with_columns(pl.lit(seq, pl.Int64).alias(SEQ))


def distinct_count(values: pl.Series) -> int:
    """How many distinct values; sorted ones (ids stored in input order) need no hash table."""
    if values.is_sorted():
        values = values.set_sorted()
    return values.n_unique()


def pick_winners(rows: pl.DataFrame, id_column: str) -> pl.DataFrame:
    """One row per id by the rule in the module docstring; ``_seq`` becomes the id's newest."""
    if rows.height == 0 or distinct_count(rows.get_column(id_column)) == rows.height:
        return rows
    by_id = pl.col(id_column)
    return (
        rows.sort(SEQ)
        .with_columns(
            pl.col(INPUT_HASH).last().over(by_id).alias("__hash"),
            pl.col(SEQ).last().over(by_id).alias("__newest"),
        )
        .filter(pl.col(INPUT_HASH) == pl.col("__hash"))
        .sort([pl.col(ERROR).is_null(), pl.col(SEQ)])
        .unique(subset=[id_column], keep="last", maintain_order=True)
        .with_columns(pl.col("__newest").alias(SEQ))
        .drop("__hash", "__newest")
    )


def concat(frames: Sequence[pl.DataFrame], where: str) -> pl.DataFrame:
    """Stored rows of several files as one frame; files that disagree on types are corrupt."""
    if len(frames) == 1:
        return frames[0]
    try:
        return pl.concat(frames, how="diagonal_relaxed")
    except Exception as e:
        raise CorruptCheckpointError(
            where, f"has files that disagree on their columns ({e})"
        ) from e


def resolve(frames: Sequence[pl.DataFrame], id_column: str, where: str) -> pl.DataFrame:
    """The stored rows of several files, one winning row per id (see ``pick_winners``)."""
    return pick_winners(concat(frames, where), id_column)
