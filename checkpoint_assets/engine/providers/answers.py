"""Answers kept: each row of a request/parse job stores the provider's response body, so a
changed ``parse`` re-derives the outputs with no call.

The column is ``_answer`` (``ANSWER``, one of the bookkeeping columns of ``rows.py``): the body as
compact JSON text (:func:`dumps`), a String column, which the checkpoint's Parquet codecs
compress. A failed row keeps the body its ``parse`` raised for; a request the provider refused
has none (its words are in ``_error``). ``ProviderJob.keep_answers`` False stores no column.

Re-deriving. When the parse part of the function's fingerprint changed and its request part did
not (``function_fingerprint.py``), ``opening.py`` hands over the stored rows that have an answer
(``Rederive``). :func:`reparse` passes each answer through the new ``parse``: the row's outputs
are replaced, its id, input hash, attempts and answer kept. A ``parse`` that raises makes the row
failed with its text, as at collection. Nothing is sent and nothing is priced.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls.batches import Broken, Check, RowResult
from checkpoint_assets.engine.errors import FunctionError
from checkpoint_assets.engine.rows import ANSWER, ATTEMPTS, ERROR, INPUT_HASH

__all__ = ["ANSWER", "Reparsed", "dumps", "parse_error", "reparse"]

_ROWS_PER_CHUNK = 16_384  # answers parsed between two hand-overs to the sink


def dumps(body: Mapping[str, Any]) -> str:
    """A response body as stored in ``_answer``: compact JSON text."""
    return json.dumps(body, separators=(",", ":"))


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


def reparse(
    stored: pl.DataFrame,
    parse: Callable[[dict[str, Any]], Mapping[str, Any]],
    check: Check,
    label: str,
) -> Iterator[Reparsed]:
    """``parse`` over the answers of ``stored`` (id, ``_input_hash``, ``_attempts``,
    ``_answer``), a chunk at a time. A result that is no dict of the same columns raises
    :class:`FunctionError`, as at collection."""
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
