"""Answers kept: each row of a request/parse job stores the provider's response body, so a
changed ``parse`` re-derives the outputs with no call.

The column is ``_answer`` (``ANSWER``, one of the bookkeeping columns of ``rows.py``): the body as
compact JSON text (:func:`dumps`), a String column, which the checkpoint's Parquet codecs
compress. A failed row keeps the body its ``parse`` raised for; a request the provider refused
has none (its words are in ``_error``). ``ProviderJob.keep_answers`` False stores no column.

Re-deriving. When the parse part of the function's fingerprint changed
(``function_fingerprint.py``), ``opening.py`` hands the stored rows over (``Rederive``), and the
work loop calls :func:`rederive` before anything else. It writes a new generation of the
checkpoint holding every stored row:

- rows with an answer, passed through the new ``parse`` (``plan/reparse.py``). Their outputs
  are replaced; id, input hash, attempts and answer are kept. A ``parse`` that raises makes the
  row failed with its text, as at collection.
- the other rows as they are.

Nothing is sent and nothing is priced. Finished rows without an answer keep their outputs,
unless the run asks to compute them again. Until the new generation begins, the rows written are
the newest of the current one: a run killed meanwhile leaves the next run to parse them all again.

Rows taken from the result store are parsed again too, whatever parse stored them
(``plan/from_store.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls.batches import Check, build
from checkpoint_assets.engine.loop.shard_run import ShardRun
from checkpoint_assets.engine.loop.sink import PartWriter
from checkpoint_assets.engine.plan.inputs import POSITION
from checkpoint_assets.engine.plan.opening import Rederive
from checkpoint_assets.engine.plan.reparse import Parse, parse_error, reparse
from checkpoint_assets.engine.rows import ANSWER

__all__ = ["ANSWER", "dumps", "parse_error", "rederive"]


def dumps(body: Mapping[str, Any]) -> str:
    """A response body as stored in ``_answer``: compact JSON text."""
    return json.dumps(body, separators=(",", ":"))


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
