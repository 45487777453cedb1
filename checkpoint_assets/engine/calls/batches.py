"""What one call takes and gives back, and the stored rows of many calls built at once.

A call takes a *batch*: input rows as a frame (``FrameBatch``), or one row as a dict for a
per-row function (``RowBatch``, see :class:`PerRow`).

What the function returns is checked on the worker that called it. It must be a table with the
batch's ids, or a dict with the same keys for every row, and use no reserved names. It is kept
as a cheap *record*: the frame or the dict it returned.

The run loop builds the stored rows of every record a flush takes at once (:func:`build`).
Polars work on a one-row frame costs more than a remote call's own Python work. So it is paid
once per flush, not once per call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl
import pyarrow as pa

from checkpoint_assets.engine.rows import ATTEMPTS, BOOKKEEPING, ERROR, INPUT_HASH, NO_RESULT

_ROWS_PER_CHUNK = 1024  # input rows turned into dicts at a time, for a per-row function
_NO_ERROR = pl.Series(ERROR, [None], dtype=pl.String)


class Broken(Exception):
    """The function is broken: retrying cannot help."""


class RowFailed(Exception):
    """Raised by a function whose rows failed for good although the endpoint answered (a
    request/parse job's ``parse`` raised): they are stored failed at once, with its text."""


@dataclass(frozen=True)
class PerRow:
    """A function of one row: it takes a dict (the id and the input columns) and returns a dict
    of its output columns (the id may be left out). ``fn`` may be ``async def``."""

    fn: Callable[[dict[str, Any]], Any]


# -- records: what calls returned, checked, not yet built into stored rows --------------------
@dataclass(frozen=True, slots=True)
class FrameResult:
    """A frame the function returned, row for row the ``book`` rows of its batch."""

    out: pl.DataFrame
    book: pl.DataFrame  # the id, ``_attempts`` and ``_input_hash`` of the batch's rows
    used: int  # calls that included these rows, this one too


@dataclass(frozen=True, slots=True)
class RowResult:
    """The dict a per-row function returned for one row."""

    out: Mapping[str, Any]
    id: Any
    input_hash: int
    attempts: int  # calls that included the row, this one too


Record = FrameResult | RowResult


def height(record: Record) -> int:
    return 1 if isinstance(record, RowResult) else record.out.height


# -- batches ---------------------------------------------------------------------------------
class Check:
    """What every result of a shard must be; shared by the shard's workers."""

    def __init__(self, id_column: str) -> None:
        self.id_column = id_column
        self._keys: Any = None  # the keys of the first dict a per-row function returned
        self._outputs: frozenset[str] | None = None
        self._lock = threading.Lock()

    def frame(self, raw: Any, batch: pl.DataFrame) -> tuple[pl.DataFrame, bool]:
        """``raw`` as a frame of results for ids of ``batch``, and whether they are ``batch``'s
        own ids in its order (the usual case); raises :class:`Broken` when it cannot be."""
        out = _as_frame(raw)
        if out is None:
            raise Broken(
                f"it returned {type(raw).__name__}; it must return a polars DataFrame "
                f"with the id column {self.id_column!r} and the output columns"
            )
        if self.id_column not in out.columns:
            raise Broken(
                f"its result has no id column {self.id_column!r} "
                f"(columns: {out.columns}); return the id with each result"
            )
        reserved = [c for c in out.columns if c in BOOKKEEPING]
        if reserved:
            raise Broken(f"its result uses reserved column names {reserved}")
        ids = out.get_column(self.id_column)
        wanted = batch.get_column(self.id_column)
        if ids.dtype == wanted.dtype and ids.equals(wanted):
            return out, True  # nothing more to check
        if ids.null_count():
            raise Broken("it returned results with a null id")
        if ids.n_unique() != out.height:
            raise Broken("it returned more than one result for some ids")
        if ids.dtype != wanted.dtype:
            try:
                out = out.with_columns(pl.col(self.id_column).cast(wanted.dtype, strict=True))
            except Exception as e:
                raise Broken(f"it returned ids of type {ids.dtype}: {e}") from e
        unknown = out.join(batch.select(self.id_column), on=self.id_column, how="anti")
        if unknown.height:
            sample = unknown.get_column(self.id_column).head(5).to_list()
            raise Broken(f"it returned ids that were not in its batch: {sample}")
        return out, False

    def row(self, raw: Any, row_id: Any) -> Mapping[str, Any]:
        """``raw`` as the outputs of the row ``row_id``; raises :class:`Broken` when it cannot
        be. Every row must return the same keys (the id may be left out)."""
        if not isinstance(raw, dict | Mapping):
            raise Broken(
                f"it returned {type(raw).__name__}; a per-row function must return a dict of "
                "its output columns"
            )
        if raw.keys() != self._keys:  # the keys of the first result, checked (the usual case)
            self._new_keys(raw)
        if self.id_column in raw and raw[self.id_column] != row_id:
            raise Broken(
                f"it returned the id {raw[self.id_column]!r} for the row with id {row_id!r}; "
                "leave the id out of the result, or return the row's own"
            )
        return dict(raw)  # a copy: a function may reuse its dict for the next row

    def _new_keys(self, raw: Mapping[str, Any]) -> None:
        outputs = frozenset(k for k in raw if k != self.id_column)
        with self._lock:
            if self._outputs is None:
                odd = [k for k in outputs if not isinstance(k, str)]
                if odd:
                    raise Broken(f"its result has keys that are not strings: {odd[:5]}")
                reserved = sorted(outputs & set(BOOKKEEPING))
                if reserved:
                    raise Broken(f"its result uses reserved column names {reserved}")
                self._outputs, self._keys = outputs, dict.fromkeys(raw).keys()
            elif outputs != self._outputs:
                raise Broken(
                    f"it returned the keys {sorted(map(str, outputs))} for one row and "
                    f"{sorted(self._outputs)} for another; return the same output columns "
                    "for every row (None where a value is missing)"
                )


@dataclass(frozen=True, slots=True)
class FrameBatch:
    """Input rows as a frame: the function gets ``rows``."""

    rows: pl.DataFrame  # the id and the input columns
    book: pl.DataFrame  # the id, ``_attempts`` and ``_input_hash`` of the same rows

    @property
    def height(self) -> int:
        return self.rows.height

    @property
    def argument(self) -> pl.DataFrame:
        return self.rows

    @property
    def fresh(self) -> bool:
        """Whether a row of it was never tried before."""
        return bool(self.book.get_column(ATTEMPTS).min() == 0)

    def halves(self) -> tuple[FrameBatch, FrameBatch]:
        half = self.height // 2
        head = FrameBatch(self.rows.head(half), self.book.head(half))
        return head, FrameBatch(self.rows.slice(half), self.book.slice(half))

    def results(self, raw: Any, used: int, check: Check) -> tuple[Record, pl.DataFrame | None]:
        """The record of what the function returned, and the failures of rows it skipped."""
        out, aligned = check.frame(raw, self.book)
        if aligned:
            return FrameResult(out, self.book, used), None
        id_column = check.id_column
        ids = out.select(id_column)
        book = ids.join(self.book, on=id_column, how="left", maintain_order="left")
        if out.height == self.height:  # its ids are unique and from the batch (checked)
            return FrameResult(out, book, used), None
        missing = self.book.join(ids, on=id_column, how="anti")
        reason = NO_RESULT
        return FrameResult(out, book, used), _failed(missing, id_column, reason, used)

    def failures(self, error: str, used: int, id_column: str) -> pl.DataFrame:
        return _failed(self.book, id_column, error, used)


@dataclass(frozen=True, slots=True)
class RowBatch:
    """One input row as a dict: a per-row function gets ``row``."""

    row: dict[str, Any]  # the id and the input columns
    id: Any
    input_hash: int
    attempts: int
    height = 1

    @property
    def fresh(self) -> bool:
        return self.attempts == 0

    @property
    def argument(self) -> dict[str, Any]:
        return self.row

    def halves(self) -> tuple[RowBatch, RowBatch]:
        raise AssertionError("a single row is never split")

    def results(self, raw: Any, used: int, check: Check) -> tuple[Record, pl.DataFrame | None]:
        return RowResult(
            check.row(raw, self.id), self.id, self.input_hash, self.attempts + used
        ), None

    def failures(self, error: str, used: int, id_column: str) -> pl.DataFrame:
        return pl.DataFrame(
            {
                id_column: [self.id],
                INPUT_HASH: pl.Series([self.input_hash], dtype=pl.UInt64),
                ERROR: pl.Series([error], dtype=pl.String),
                ATTEMPTS: pl.Series([self.attempts + used], dtype=pl.Int32),
            }
        )


Batch = FrameBatch | RowBatch


def batches(todo: pl.DataFrame, id_column: str, size: int, per_row: bool) -> Iterator[Batch]:
    """The batches of ``todo`` (prepared rows with ``_attempts``) in order, made as they are taken.

    They are slices of ``size`` rows, or one dict per row (made a chunk of rows at a time)."""
    visible = todo.select([c for c in todo.columns if c not in BOOKKEEPING])
    if per_row:
        for start in range(0, todo.height, _ROWS_PER_CHUNK):
            chunk = todo.slice(start, _ROWS_PER_CHUNK)
            rows = visible.slice(start, _ROWS_PER_CHUNK).to_dicts()
            hashes = chunk.get_column(INPUT_HASH).to_list()
            attempts = chunk.get_column(ATTEMPTS).to_list()
            for row, input_hash, tried in zip(rows, hashes, attempts, strict=True):
                yield RowBatch(row, row[id_column], input_hash, tried)
        return
    book = todo.select(id_column, ATTEMPTS, INPUT_HASH)
    for start in range(0, todo.height, size):
        yield FrameBatch(visible.slice(start, size), book.slice(start, size))


# -- building stored rows --------------------------------------------------------------------
def build(records: Sequence[Record], id_column: str, id_dtype: pl.DataType) -> list[pl.DataFrame]:
    """The stored rows of ``records``, in as few frames as their types allow.

    When every result has the same types, that is one frame (two when both kinds are there).
    Else it is one frame per record, in order. The caller then checks them one by one, and
    keeps those before a result whose types changed."""
    frames = [r for r in records if isinstance(r, FrameResult)]
    rows = [r for r in records if isinstance(r, RowResult)]
    try:
        built = [_build_frames(frames)] if frames else []
        return built + ([_build_rows(rows, id_column, id_dtype)] if rows else [])
    except (pl.exceptions.PolarsError, TypeError):  # types differ between results
        return [_one(r, id_column, id_dtype) for r in records]


def _build_frames(records: Sequence[FrameResult]) -> pl.DataFrame:
    # Strict concatenation: results whose types differ are not coerced here (see ``build``).
    # Plain Series, not expressions: the expression engine costs a millisecond a call.
    outs = pl.concat([r.out for r in records], how="vertical", rechunk=True)
    book = pl.concat([r.book for r in records], how="vertical", rechunk=True)
    attempts = book.get_column(ATTEMPTS) + _each_row(records)
    return outs.hstack(
        [book.get_column(INPUT_HASH), attempts.cast(pl.Int32), _no_errors(outs.height)]
    )


def _build_rows(
    records: Sequence[RowResult], id_column: str, id_dtype: pl.DataType
) -> pl.DataFrame:
    outputs = [k for k in records[0].out if k != id_column]
    columns = [pl.Series(id_column, [r.id for r in records], dtype=id_dtype)]
    for name in outputs:  # strict: a type that changes between rows fails (see ``build``)
        columns.append(pl.Series(name, [r.out[name] for r in records], strict=True))
    columns.append(pl.Series(INPUT_HASH, [r.input_hash for r in records], dtype=pl.UInt64))
    columns.append(pl.Series(ATTEMPTS, [r.attempts for r in records], dtype=pl.Int32))
    columns.append(_no_errors(len(records)))
    return pl.DataFrame(columns)


def _each_row(records: Sequence[FrameResult]) -> int | pl.Series:
    """The attempts each record's call used, for each of its rows.

    It is one number when every call used the same, the usual case. That saves a list of a value
    per row, which costs 0.1 s per 1M rows."""
    used = {r.used for r in records}
    if len(used) == 1:
        return used.pop()
    counts = pl.Series([r.out.height for r in records], dtype=pl.UInt32)
    each = pl.Series([r.used for r in records], dtype=pl.Int32)
    return pl.select(pl.lit(each).repeat_by(counts).explode()).to_series()


def _no_errors(rows: int) -> pl.Series:
    # ``new_from_index`` costs microseconds; ``pl.repeat`` runs a query, a tenth of a millisecond.
    return _NO_ERROR.new_from_index(0, rows)


def _one(record: Record, id_column: str, id_dtype: pl.DataType) -> pl.DataFrame:
    if isinstance(record, FrameResult):
        return _build_frames([record])
    return _build_rows([record], id_column, id_dtype)


def _plus(used: int | pl.Expr | pl.Series) -> pl.Expr:
    return (pl.col(ATTEMPTS) + used).cast(pl.Int32).alias(ATTEMPTS)


def _failed(rows: pl.DataFrame, id_column: str, error: str, used: int) -> pl.DataFrame:
    return rows.select(id_column, INPUT_HASH, pl.lit(error, pl.String).alias(ERROR), _plus(used))


def _as_frame(raw: Any) -> pl.DataFrame | None:
    if isinstance(raw, pl.DataFrame):
        return raw
    if isinstance(raw, pl.LazyFrame):
        return raw.collect()
    if isinstance(raw, (pa.Table, pa.RecordBatch)):
        frame = pl.from_arrow(raw)
        return frame if isinstance(frame, pl.DataFrame) else None
    if isinstance(raw, dict):
        return pl.DataFrame(raw)
    return None
