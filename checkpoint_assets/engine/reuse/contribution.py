"""What one shard adds to the result store: its results, once the files holding them are durable.

The sink hands over the rows of each part after the part is written, and those of the merged
file after finalize (``durable``). Successful rows are held until ``BATCH_ROWS`` of them are, or
the run ends (``close``), then stored in one file per bucket: a few large files, not many tiny
ones. Failed rows (``_error``) are never stored; a row's ``_answer`` is, beside its outputs. A
store that cannot be written is logged and the run goes on: its results are safe in the
checkpoint, and only later reuse of them is lost.
"""

from __future__ import annotations

import logging

import polars as pl

from checkpoint_assets.engine.reuse.layout import id_key, stored_keys
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.rows import ANSWER, ERROR, outputs_of

BATCH_ROWS = 1 << 16
Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]


class Contribution:
    """A shard's results on their way into the result store.

    ``keys``: the shard's id and content key columns ``hi`` and ``lo`` (UInt64) of every row.
    """

    def __init__(
        self,
        results: ResultStore,
        scope: str,
        keys: pl.DataFrame,
        *,
        id_column: str,
        hi: str,
        lo: str,
        log: Logger,
        batch_rows: int = BATCH_ROWS,
    ) -> None:
        self.results = results
        self.scope = scope
        where = id_key(id_column, keys.schema[id_column])
        self.keys = keys.select(id_column, *stored_keys(hi, lo), where)
        self.id_column = id_column
        self.log = log
        self.batch_rows = batch_rows
        self.held: list[pl.DataFrame] = []
        self.held_rows = 0
        self.stored = 0  # rows added to the store by this run
        self.failed = False

    def durable(self, rows: pl.DataFrame) -> None:
        """``rows`` (stored rows) are durable in the checkpoint: hold the successful ones."""
        if self.failed:
            return
        if ERROR in rows.columns:
            rows = rows.filter(pl.col(ERROR).is_null())
        if not rows.height:
            return
        answer = [ANSWER] if ANSWER in rows.columns else []  # a later parse may read it again
        self.held.append(rows.select(self.id_column, *outputs_of(rows, self.id_column), *answer))
        self.held_rows += rows.height
        if self.held_rows >= self.batch_rows:
            self.write()

    def write(self) -> None:
        """Store the rows held; a failure is logged, once, and the rows dropped."""
        held, self.held, self.held_rows = self.held, [], 0
        if not held or self.failed:
            return
        try:
            frame = pl.concat(held, how="diagonal_relaxed")
            keyed = frame.join(self.keys, on=self.id_column, how="inner").drop(self.id_column)
            self.stored += self.results.add(self.scope, keyed)
        except Exception as e:  # the results are in the checkpoint: the run goes on
            self.failed = True
            self.log.warning(
                "Could not add results to the result store %s (%s). They are kept in the "
                "checkpoint; later runs cannot reuse them. This run adds no more.",
                self.results.url,
                e,
            )
