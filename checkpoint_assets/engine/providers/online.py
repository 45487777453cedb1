"""The online way of a request/parse job: each row's request sent at once, its answer parsed.

A request/parse job (``provider_batch_asset``) is ``request(row) -> body`` and ``parse(answer)
-> outputs``. ``provider_batches.ProviderRun`` sends it as provider batches. Here it runs per
row through the endpoint resource's ``send``, on the engine's ``Run`` loop (``PerRow``:
concurrency, rate limits, retries, flushes):

- :class:`Online` holds the per-row ``async`` function (``one_row``): build the row's body,
  send it, parse the answer. It keeps each answer (``answers.dumps``) until the loop takes the
  row's result.
- :func:`finish` runs it over some rows of a ``ProviderRun``, with the shard's own sink,
  counts, throttle and spend. An online run gives it every row. A hybrid run gives it the rows
  its batches left without a result. Its loop adds each answer to its row as ``_answer``
  (``keep_answers``), as in a batch. This includes the failed rows whose ``parse`` raised.

As in a batch, a row whose ``parse`` raised fails at once with its text (``RowFailed``). Its
request was answered, so it is neither asked again nor counted towards an outage. A ``request``
that raises stops the shard (``Broken``), as in a batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls.batches import Broken, PerRow, Record, RowFailed, RowResult
from checkpoint_assets.engine.calls.caller import Outcome
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.loop.runner import Run
from checkpoint_assets.engine.loop.shard_run import RunContext, ShardRun
from checkpoint_assets.engine.providers.answers import ANSWER, dumps, parse_error

Send = Callable[[Mapping[str, Any]], Awaitable[Any]]


@dataclass
class Online:
    """The per-row function of the online way, and the answers it got (see the module
    docstring). ``keep_answers`` False keeps none."""

    request: Callable[[dict[str, Any]], dict[str, Any]]
    parse: Callable[[dict[str, Any]], Mapping[str, Any]]
    send: Send
    id_column: str
    keep_answers: bool = True
    answers: dict[Any, str] = field(default_factory=dict)  # by row id, until the loop takes them

    async def one_row(self, row: dict[str, Any]) -> Any:
        body = await self.send(self._body(row))
        if self.keep_answers:
            self.answers[row[self.id_column]] = dumps(body)
        try:
            return self.parse(body)
        except Exception as e:
            raise RowFailed(parse_error(e)) from e

    def _body(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row's request body; a ``request`` that raises or returns no dict is a broken
        function, which stops the shard, as in a batch."""
        try:
            body = self.request(row)
        except Exception as e:
            row_id = row[self.id_column]
            raise Broken(f"request() raised {type(e).__name__}: {e} for the row {row_id!r}") from e
        if not isinstance(body, dict):
            raise Broken(f"request() returned {type(body).__name__}; it must return a dict")
        return body


class _OnlineRun(Run):
    """``Run`` whose rows get their answers (``Online.answers``) as the loop takes them."""

    online: Online

    def _absorb(self, outcomes: list[Outcome], *, outage: bool) -> None:
        if self.online.keep_answers:
            for outcome in outcomes:
                outcome.ok = [self._answered(r) for r in outcome.ok]
                outcome.failed = [self._failed_answered(f) for f in outcome.failed]
        super()._absorb(outcomes, outage=outage)

    def _answered(self, record: Record) -> Record:
        answer = self.online.answers.pop(getattr(record, "id", None), None)
        if not isinstance(record, RowResult) or answer is None:
            return record
        return RowResult(
            {**record.out, ANSWER: answer}, record.id, record.input_hash, record.attempts
        )

    def _failed_answered(self, failed: pl.DataFrame) -> pl.DataFrame:
        """A parse that raised leaves the answer it raised for; a failed request leaves none."""
        ids = failed.get_column(self.id).to_list()
        answers = [self.online.answers.pop(i, None) for i in ids]
        return failed.with_columns(pl.Series(ANSWER, answers, dtype=pl.String))


def finish(shard: ShardRun, online: Online, keys: pl.DataFrame) -> CheckpointError | None:
    """Run ``online.one_row`` over the rows of ``keys`` on the ``Run`` loop.

    ``keys`` are rows of the shard's keys, in order, with ``_attempts``. Results are stored
    through ``shard``'s sink, and the rows done count as ``shard``'s. Returns why it stopped
    early, or None.
    """
    settings = dataclasses.replace(shard.s, batch_size=1)  # one request per call
    context = RunContext(logger=shard.log, label=shard.label, spend=shard.spend)
    fn = PerRow(online.one_row)
    run = _OnlineRun(fn, shard.prepared, settings, shard.opened, shard.sink, shard.stats, context)
    run.online = online
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
