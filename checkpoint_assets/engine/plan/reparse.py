"""Stored answers parsed again: a request/parse job's outputs derived from its kept ``_answer``.

Two steps read answers again with the current ``parse``, and no request: a run whose ``parse``
changed (``providers/answers.py``), and rows taken from the result store (``from_store.py``).
A row whose ``parse`` raises is failed with its text, as at collection; its answer is kept.
A result that is no dict of the same columns raises :class:`FunctionError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls.batches import Broken, Check, RowResult, build
from checkpoint_assets.engine.errors import FunctionError
from checkpoint_assets.engine.rows import ANSWER, ATTEMPTS, ERROR, INPUT_HASH

Parse = Callable[[dict[str, Any]], Mapping[str, Any]]

_ROWS_PER_CHUNK = 16_384  # answers parsed at a time


def parse_error(e: Exception) -> str:
    """The ``_error`` of a row whose ``parse`` raised."""
    return f"parse() raised {type(e).__name__}: {e}"


@dataclass(frozen=True)
class Reparsed:
    """The rows of one chunk of answers passed through ``parse``: outputs, and failures."""

    ok: list[RowResult]  # each ``out`` holds the answer under ``ANSWER``
    failed: pl.DataFrame  # id, ``_input_hash``, ``_error``, ``_attempts``, ``_answer``

    @property
    def height(self) -> int:
        return len(self.ok) + self.failed.height


def reparse(stored: pl.DataFrame, parse: Parse, check: Check, label: str) -> Iterator[Reparsed]:
    """``parse`` over the answers of ``stored`` (id, ``_input_hash``, ``_attempts``,
    ``_answer``), a chunk at a time."""
    id_column = check.id_column
    columns = [id_column, INPUT_HASH, ATTEMPTS, ANSWER]
    done = 0
    for start in range(0, stored.height, _ROWS_PER_CHUNK):
        chunk = stored.select(columns).slice(start, _ROWS_PER_CHUNK)
        ok: list[RowResult] = []
        failed: list[tuple[Any, int, str, int, str]] = []
        for row_id, input_hash, attempts, answer in chunk.iter_rows():
            try:
                out = parse(json.loads(answer))
            except Exception as e:
                failed.append((row_id, input_hash, parse_error(e), attempts, answer))
                continue
            try:
                checked = check.row(out, row_id)
            except Broken as e:
                raise FunctionError(label, f"parse(): {e}", done) from None
            ok.append(RowResult({**checked, ANSWER: answer}, row_id, input_hash, attempts))
        done += chunk.height
        yield Reparsed(ok, _failures(failed, id_column, stored.schema[id_column]))


def stored_rows(stored: pl.DataFrame, parse: Parse, id_column: str, label: str) -> pl.DataFrame:
    """The rows of ``stored`` (id, ``_input_hash``, ``_attempts``, ``_answer``; one at least) as
    stored rows: their outputs from their answer, or failed."""
    frames: list[pl.DataFrame] = []
    id_dtype = stored.schema[id_column]
    for chunk in reparse(stored, parse, Check(id_column), label):
        frames += build(chunk.ok, id_column, id_dtype)
        frames.append(chunk.failed)
    kept = [f for f in frames if f.height]
    return pl.concat(kept, how="diagonal_relaxed") if kept else frames[0]


def _failures(
    failed: list[tuple[Any, int, str, int, str]], id_column: str, id_dtype: pl.DataType
) -> pl.DataFrame:
    ids, hashes, errors, attempts, answers = zip(*failed, strict=True) if failed else ((),) * 5
    return pl.DataFrame(
        {
            id_column: pl.Series(list(ids), dtype=id_dtype),
            INPUT_HASH: pl.Series(list(hashes), dtype=pl.UInt64),
            ERROR: pl.Series(list(errors), dtype=pl.String),
            ATTEMPTS: pl.Series(list(attempts), dtype=pl.Int32),
            ANSWER: pl.Series(list(answers), dtype=pl.String),
        }
    )
