"""The online way of a request/parse job: each row's request sent at once, its answer parsed.

A request/parse job (``provider_batch_asset``) is ``request(row) -> body`` and ``parse(answer)
-> outputs``. ``provider_batches.ProviderRun`` sends it as provider batches; here it runs per
row through the endpoint resource's ``send``:

- :func:`answering` makes the per-row ``async`` function: build the row's body, send it, parse
  the answer, and return the outputs with ``_answer`` beside them (:func:`with_answer`).
- :func:`finish` runs that function over some rows of a ``ProviderRun`` on the engine's
  ``Run`` loop (``PerRow``: concurrency, rate limits, retries, flushes), on the shard's own sink,
  counts, throttle and spend. Those rows are every row of an online run, and the rows a hybrid
  run's batches left without a result.

Every stored row of a request/parse job carries ``_answer``: the provider's response body as
compact JSON text (a String column, compressed by Parquet's zstd), whichever way it was asked.

A call retried after its answer came (``parse`` raised) parses the same answer again: it is not
asked again. The row fails with ``parse``'s error after ``max_attempts``, as in a batch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import polars as pl

from checkpoint_assets.engine.calls.batches import PerRow
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.loop.runner import Run
from checkpoint_assets.engine.loop.shard_run import RunContext, ShardRun

#: The column of a request/parse job's stored rows that holds each row's response body.
ANSWER: Final = "_answer"

Send = Callable[[Mapping[str, Any]], Awaitable[Any]]


class ParseError(Exception):
    """``parse`` raised on an answer: the row fails with its text (the answer is kept)."""


def answer_text(body: Any) -> str:
    """A response body as it is stored in ``_answer``: compact JSON.

    >>> answer_text({"choices": [{"message": {"content": "billing"}}]})
    '{"choices":[{"message":{"content":"billing"}}]}'
    """
    return json.dumps(body, separators=(",", ":"))


def with_answer(outputs: Any, body: Any) -> Any:
    """``parse``'s outputs with ``_answer`` added (anything but a dict is left for the row
    check to refuse)."""
    if not isinstance(outputs, Mapping):
        return outputs
    return {**outputs, ANSWER: answer_text(body)}


def answering(
    request: Callable[[dict[str, Any]], dict[str, Any]],
    parse: Callable[[dict[str, Any]], Mapping[str, Any]],
    send: Send,
    id_column: str,
) -> Callable[[dict[str, Any]], Awaitable[Any]]:
    """The per-row function of the online way (see the module docstring)."""
    kept: dict[Any, Any] = {}  # answers whose parse raised, by row id: parsed again, not asked

    async def one_row(row: dict[str, Any]) -> Any:
        row_id = row[id_column]
        body = kept.pop(row_id, None)
        if body is None:
            body = await send(request(row))
        try:
            outputs = parse(body)
        except Exception as e:
            kept[row_id] = body
            raise ParseError(f"parse() raised {type(e).__name__}: {e}") from e
        return with_answer(outputs, body)

    return one_row


def finish(
    shard: ShardRun, fn: Callable[[dict[str, Any]], Awaitable[Any]], keys: pl.DataFrame
) -> CheckpointError | None:
    """Run ``fn`` (from :func:`answering`) over the rows of ``keys`` (rows of the shard's keys,
    in order, with ``_attempts``) on the ``Run`` loop, storing through ``shard``'s sink; returns
    why it stopped early, or None. The rows done count as ``shard``'s."""
    settings = dataclasses.replace(shard.s, batch_size=1)  # one request per call
    context = RunContext(logger=shard.log, label=shard.label, spend=shard.spend)
    run = Run(PerRow(fn), shard.prepared, settings, shard.opened, shard.sink, shard.stats, context)
    run.throttle = shard.throttle  # one shard: its rate limits and their metadata are shared
    computed = shard.stats.rows_computed
    try:
        return run.work(keys)
    except BaseException:
        run._keep_what_is_done()
        raise
    finally:
        shard.done_rows += run.done_rows
        shard.failed_rows += run.failed_rows
        shard.last_error = run.last_error or shard.last_error
        shard.stats.rows_online += shard.stats.rows_computed - computed
