"""A shard's input rows, read a slice at a time: a run never holds its whole input.

A run reads its input twice, each time a slice of about ``SLICE_ROWS`` rows at a time::

    prepare()          the id and input columns: each row's input hash is computed and its
                       input dropped; what stays is the shard's keys (id, input hash, position)
    plan               (opening.py) the keys against the checkpoint: the rows to compute
    Prepared.todo()    the rows to compute, read again as the calls take them, each slice
                       checked against the keys (the same ids at the same positions)

So a shard holds its keys (about 24 bytes a row), one slice of input and the batches in flight,
whatever the size of its input columns. An :class:`Inputs` reads the same rows in the same
order every time: a frame in memory (:class:`FrameInputs`), or what the Dagster layer reads
from a stored source (``integration/store/source.py``).
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from checkpoint_assets.engine.errors import CheckpointError, MissingColumnsError
from checkpoint_assets.engine.plan.resume import DEDUPE_KEY, SOURCE_ROW, validate_ids
from checkpoint_assets.engine.rows import ATTEMPTS, INPUT_HASH, distinct_count
from checkpoint_assets.engine.settings import Settings
from checkpoint_assets.engine.sharding import hashing

# Rows read at a time: two row groups of the keyed layout (``keyed.ROW_GROUP_ROWS``).
SLICE_ROWS = 1 << 15
# A row's position in the shard's input (counted from 0): where the second read finds it.
POSITION = "__position"
# The low half of a row's content key (its high half is ``DEDUPE_KEY``).
CONTENT_LO = "__content_lo"


class Inputs(abc.ABC):
    """Rows that can be read more than once, a slice at a time, in the same order each time."""

    @property
    @abc.abstractmethod
    def schema(self) -> pl.Schema:
        """The columns and their types."""

    @abc.abstractmethod
    def slices(self, columns: Sequence[str]) -> Iterator[pl.DataFrame]:
        """The rows, ``columns`` only, a slice of at most about ``SLICE_ROWS`` rows at a time."""

    def numbered(self, ids: pl.DataFrame) -> pl.DataFrame:
        """``ids`` (every row's id, in order) with the source row (``SOURCE_ROW``) of those that
        will be refused, for the error; unchanged: positions are the rows' own."""
        return ids


class FrameInputs(Inputs):
    """Rows of a frame in memory."""

    def __init__(self, frame: pl.DataFrame) -> None:
        self.frame = frame

    @property
    def schema(self) -> pl.Schema:
        return self.frame.schema

    def slices(self, columns: Sequence[str]) -> Iterator[pl.DataFrame]:
        chosen = self.frame.select(columns)
        for start in range(0, chosen.height, SLICE_ROWS):
            yield chosen.slice(start, SLICE_ROWS)


class Limited(Inputs):
    """The first ``limit`` rows of ``inputs`` (a run's ``limit``)."""

    def __init__(self, inputs: Inputs, limit: int) -> None:
        self.inputs = inputs
        self.limit = limit

    @property
    def schema(self) -> pl.Schema:
        return self.inputs.schema

    def slices(self, columns: Sequence[str]) -> Iterator[pl.DataFrame]:
        left = self.limit
        for rows in self.inputs.slices(columns):
            if left <= 0:
                return
            yield rows.head(left)
            left -= rows.height

    def numbered(self, ids: pl.DataFrame) -> pl.DataFrame:
        return self.inputs.numbered(ids)


@dataclass(frozen=True)
class Prepared:
    """A shard's input, prepared: its keys in memory and its rows where they are read from.

    ``keys``: the id (as stored: integers as Int64), ``_input_hash`` and ``POSITION`` of every
    input row, in order, and the dedupe key (``DEDUPE_KEY``) when the run dedupes. With
    ``content``, the row's content key too: ``DEDUPE_KEY`` is its high half, ``CONTENT_LO``
    its low half (``hashing.content_keys``).
    ``columns``: the id and input columns, what a call sees of a row.
    """

    keys: pl.DataFrame
    rows: Inputs
    columns: tuple[str, ...]

    @property
    def id_column(self) -> str:
        return self.columns[0]

    def todo(self, todo: pl.DataFrame, size: int) -> Iterator[pl.DataFrame]:
        """The input rows of ``todo`` with their ``_input_hash`` and ``_attempts``, read a
        slice at a time.

        ``todo`` holds rows of ``keys`` in their order, with ``_attempts``. Every frame but the
        last holds a multiple of ``size`` rows, so calls take ``size`` rows each."""
        held: pl.DataFrame | None = None
        for rows in self._todo(todo):
            rows = rows if held is None else pl.concat([held, rows])
            whole = rows.height - rows.height % size
            if whole:
                yield rows.slice(0, whole)
            held = rows.slice(whole) if whole < rows.height else None
        if held is not None:
            yield held

    def _todo(self, todo: pl.DataFrame) -> Iterator[pl.DataFrame]:
        for found, wanted in self._read(todo):
            yield found.hstack(wanted.select(INPUT_HASH, ATTEMPTS).get_columns())

    def _read(self, wanted: pl.DataFrame) -> Iterator[tuple[pl.DataFrame, pl.DataFrame]]:
        """The input rows of ``wanted`` (rows of ``keys``, in order), a slice at a time, each
        with its rows of ``wanted``."""
        positions = wanted.get_column(POSITION)
        taken = start = 0
        for rows in self.rows.slices(self.columns):
            if taken == wanted.height:
                return  # the rest of the input is not wanted
            end = start + rows.height
            stop = int(positions.search_sorted(end, side="left"))
            if stop > taken:
                these = wanted.slice(taken, stop - taken)
                found = _take(_canonical(rows, self.id_column), these.get_column(POSITION) - start)
                self._check(found, these)
                yield found, these
            taken, start = stop, end
        if taken < wanted.height:
            raise self._changed(f"it ended after {start:,} rows")

    def earlier_hashes(self, rows: pl.DataFrame) -> np.ndarray:
        """The input hashes of ``rows`` (rows of ``keys``, in order) in hash format 1, from
        their input read again."""
        found = [f for f, _ in self._read(rows)]
        if not found:
            return np.empty(0, np.uint64)
        return hashing.row_hashes(pl.concat(found), self.columns, hash_format=1)

    def _check(self, found: pl.DataFrame, wanted: pl.DataFrame) -> None:
        ids, expected = found.get_column(self.id_column), wanted.get_column(self.id_column)
        if not ids.equals(expected):
            raise self._changed("its rows are not the ones read when the run started")

    def _changed(self, how: str) -> CheckpointError:
        return CheckpointError(
            f"The input of this shard changed while the run read it: {how}.",
            "Keep the source unchanged while its shards run (store a new version under a new "
            "name, or wait for the runs to end), then run the shard again: stored results are "
            "kept.",
        )


def prepare(
    source: pl.DataFrame | Inputs, settings: Settings, *, content: bool = False
) -> Prepared:
    """Validate ids and hash every input row, a slice at a time; returns the shard's keys
    (``content``: with each row's content key, for the result store).

    Ids are refused (null, duplicated, of another type) before any call of the function.
    """
    rows = source if isinstance(source, Inputs) else FrameInputs(source)
    id_column = settings.id_column
    dtype = rows.schema.get(id_column)
    if dtype is None or not (dtype.is_integer() or dtype == pl.String):
        # Refused: missing, or of another type (named with some of its values).
        found = pl.DataFrame(schema=rows.schema)
        if dtype is not None:
            found = pl.concat([found.select(id_column), *rows.slices([id_column])])
        validate_ids(found, id_column)
    missing = [c for c in settings.input_columns if c not in rows.schema]
    if missing:
        raise MissingColumnsError(missing, list(rows.schema))
    columns = (id_column, *settings.input_columns)
    numbered = [SOURCE_ROW] if SOURCE_ROW in rows.schema else []
    empty = pl.DataFrame(schema=rows.schema).select(*columns, *numbered)  # the types, if no rows
    ids: list[pl.DataFrame] = []
    keys: list[pl.DataFrame] = []
    for part in itertools.chain(rows.slices([*columns, *numbered]), [empty]):
        ids.append(part.select(id_column, *numbered))
        frame = _canonical(part.select(columns), id_column)
        keys.append(_keys(frame, columns, settings.dedupe, content))
    found = pl.concat(ids).rechunk()
    _validate(found, rows, id_column)
    hashed = pl.concat(keys).rechunk()
    stored = _canonical(found.select(id_column), id_column).hstack(hashed.get_columns())
    order = [id_column, INPUT_HASH, POSITION, *hashed.columns[1:]]
    return Prepared(stored.with_row_index(POSITION).select(order), rows, columns)


def _keys(frame: pl.DataFrame, columns: Sequence[str], dedupe: bool, content: bool) -> pl.DataFrame:
    """The input hash of each row of ``frame`` (and its dedupe key: the hash of its input; and
    its content key)."""
    hashes = {INPUT_HASH: pl.Series(INPUT_HASH, hashing.row_hashes(frame, columns), pl.UInt64)}
    if content:
        hi, lo = hashing.content_keys(frame, columns[1:])
        hashes[DEDUPE_KEY] = pl.Series(DEDUPE_KEY, hi, pl.UInt64)
        hashes[CONTENT_LO] = pl.Series(CONTENT_LO, lo, pl.UInt64)
    elif dedupe:
        key = hashing.row_hashes(frame, columns[1:])
        hashes[DEDUPE_KEY] = pl.Series(DEDUPE_KEY, key, pl.UInt64)
    return pl.DataFrame(hashes)


def _validate(ids: pl.DataFrame, rows: Inputs, id_column: str) -> None:
    """Refuse null or duplicated ids (and integers beyond Int64), with their source rows."""
    column = ids.get_column(id_column)
    if column.null_count() or distinct_count(column) != column.len():
        ids = rows.numbered(ids)
    validate_ids(ids, id_column)


def _take(frame: pl.DataFrame, rows: pl.Series) -> pl.DataFrame:
    """The ``rows`` of ``frame`` (ascending positions): a slice when they follow each other,
    which copies nothing (a fresh run takes every row)."""
    first, last = rows.first(), rows.last()
    if isinstance(first, int) and isinstance(last, int) and last - first + 1 == rows.len():
        return frame.slice(first, rows.len())
    return frame.gather(rows)


def _canonical(frame: pl.DataFrame, id_column: str) -> pl.DataFrame:
    """``frame`` with its ids as stored: integers of any width as Int64 (ids beyond it are
    refused once every id is read; meanwhile they hash as null)."""
    if frame.schema[id_column].is_integer():
        return frame.with_columns(pl.col(id_column).cast(pl.Int64, strict=False))
    return frame
