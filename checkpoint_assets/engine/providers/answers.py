"""Answers kept: each row of a request/parse job stores the provider's response body, so a
changed ``parse`` re-derives the outputs with no call.

The column is ``_answer`` (``ANSWER``, one of the bookkeeping columns of ``rows.py``): the body as
compact JSON text (:func:`dumps`), a String column, which the checkpoint's Parquet codecs
compress. A failed row keeps the body its ``parse`` raised for; a request the provider refused
has none (its words are in ``_error``). ``ProviderJob.keep_answers`` False stores no column.

Re-deriving. When the parse part of the function's fingerprint changed
(``function_fingerprint.py``), ``opening.py`` hands the stored rows over (``Rederive``), and the
work loop calls :func:`rederive` before anything else. It writes a new generation of the
checkpoint holding every stored row: those with an answer passed through the new ``parse``
(:func:`reparse`: outputs replaced; id, input hash, attempts and answer kept; a ``parse`` that
raises makes the row failed with its text, as at collection), the others as they are. Nothing is
sent and nothing is priced. Finished rows without an answer keep their outputs, unless the run
asks to compute them again. Until the new generation begins, the rows written are the newest of
the current one: a run killed meanwhile leaves the next run to parse them all again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls.batches import Broken, Check, RowResult, build
from checkpoint_assets.engine.errors import FunctionError
from checkpoint_assets.engine.loop.shard_run import ShardRun
from checkpoint_assets.engine.loop.sink import PartWriter
from checkpoint_assets.engine.plan.inputs import POSITION
from checkpoint_assets.engine.plan.opening import Rederive
from checkpoint_assets.engine.rows import ANSWER, ATTEMPTS, ERROR, INPUT_HASH

__all__ = ["ANSWER", "Reparsed", "dumps", "parse_error", "rederive", "reparse"]

Parse = Callable[[dict[str, Any]], Mapping[str, Any]]

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


def rederive(
    run: ShardRun, r: Rederive, parse: Parse, check: Check, todo: pl.DataFrame, again: bool
) -> pl.DataFrame:
    """The step of ``run`` when ``parse`` changed (see the module docstring); returns ``todo``,
    with the finished rows without answer when ``again``."""
    run.stats.rows_without_answer = r.unanswered.height
    if r.answered.height:
        _new_generation(run, r, parse, check)
    if not r.unanswered.height:
        return todo
    if not again:
        run.log.warning(
            "%s: %d finished row(s) have no stored answer (keep_answers off, or stored without "
            "one): they keep the outputs of the earlier parse(). To request them again (paid), "
            "run with `recompute_unanswered: true` in the run config.",
            run.label,
            r.unanswered.height,
        )
        return todo
    run.log.info(
        "%s: requesting %d finished row(s) again that have no stored answer "
        "(recompute_unanswered).",
        run.label,
        r.unanswered.height,
    )
    return pl.concat([todo, r.unanswered.select(todo.columns)]).sort(POSITION)


def _new_generation(run: ShardRun, r: Rederive, parse: Parse, check: Check) -> None:
    """The answered rows parsed again and the other stored rows, as a new generation."""
    sink = run.sink
    assert isinstance(sink, PartWriter)  # stored answers come from a checkpoint
    first, again, failed = sink.next_seq, 0, 0
    for chunk in reparse(r.answered, parse, check, run.label):
        for frame in build(chunk.ok, run.id, run.inputs.schema[run.id]):
            sink.learn_outputs(frame)
            sink.add(frame)
        sink.add(chunk.failed)
        again, failed = again + chunk.height, failed + chunk.failed.height
        if sink.due():
            sink.flush()
    sink.add(r.carried)
    sink.begin_generation(first)
    run.failed_rows += failed
    run.stats.rows_reparsed = again
    run.log.info(
        "%s: parse() changed: %d stored answer(s) parsed again with no request, %d of them failed.",
        run.label,
        again,
        failed,
    )


def reparse(stored: pl.DataFrame, parse: Parse, check: Check, label: str) -> Iterator[Reparsed]:
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
