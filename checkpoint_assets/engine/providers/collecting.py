"""Collecting a provider run's results: poll its submissions, store each ended one as a part,
and send its rows without a result again or fail them.

:class:`Collecting` is the part of :class:`~checkpoint_assets.engine.providers.provider_batches.
ProviderRun` that waits and collects; ``provider_batches.py`` says how the run goes.
"""

from __future__ import annotations

import time
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls.batches import Broken, RowResult
from checkpoint_assets.engine.errors import (
    BatchesPendingError,
    CheckpointError,
    FunctionError,
)
from checkpoint_assets.engine.loop.sink import PartWriter
from checkpoint_assets.engine.providers.answers import ANSWER, dumps, parse_error
from checkpoint_assets.engine.providers.job import Mode
from checkpoint_assets.engine.providers.submission_records import Submission
from checkpoint_assets.engine.providers.submissions import (
    WINDOW_SECONDS,
    QueueFull,
    Result,
    State,
    Status,
    index_of,
)
from checkpoint_assets.engine.providers.submitting import Submitting
from checkpoint_assets.engine.rows import ATTEMPTS, ERROR, INPUT_HASH

# A failed row: id, input hash, error, attempts, answer (None: none kept).
_Failed = tuple[Any, int, str, int, str | None]


class Collecting(Submitting):
    """Collecting the results of a provider run (see the module docstring)."""

    def _collect_all(self, waiting: list[Submission]) -> CheckpointError | None:
        delay = self.job.poll_seconds
        while True:
            left: list[Submission] = []
            for s in waiting:
                assert s.batch_id is not None
                status = self.provider.poll(s.batch_id)
                if status.state is State.RUNNING:
                    left.append(s)
                elif status.state is State.REFUSED:
                    self._refused(s, status.refusal or QueueFull(status.detail or "no detail"))
                    self.stats.calls -= len(s.ids)  # none of them ran
                    self._back(s.ids, s.attempt)
                else:
                    self._collect(s, status)
            waiting = left
            if self.backlog and self.job.way.mode is Mode.hybrid and self.handoff.past_deadline():
                # Past the deadline, rows still waiting for queue room go online.
                ids = [i for keys, _ in self.backlog for i in keys.get_column(self.id).to_list()]
                self.backlog = []
                self.handoff.take(self.attempts, ids)
            if self.backlog and self.refused is None:
                made = self._submit_backlog()
                if made:
                    waiting += made
                    delay = self.job.poll_seconds  # new batches: poll them from the start
            if self.handoff.rows:
                stopped = self.handoff.finish(self.todo)
                if stopped is not None:
                    return stopped  # open submissions stay recorded: the next run re-attaches
            unsubmitted = self._unsubmitted()
            if not waiting and not unsubmitted:
                return None
            if self.handoff.past_deadline() and self.handoff.cancel(waiting):
                delay = self.job.poll_seconds  # cancelled batches end soon
            rows = sum(len(s.ids) for s in waiting)
            if not self.job.way.wait and self.job.way.mode is Mode.batch:
                batches = [s.batch_id or s.tag for s in waiting]
                due = max((s.created_at for s in waiting), default=None)
                return BatchesPendingError(
                    self.label,
                    rows,
                    batches,
                    self.done_rows,
                    None if due is None else due + WINDOW_SECONDS,
                    unsubmitted=unsubmitted,
                )
            nap = delay
            self._note_waiting(unsubmitted)
            if unsubmitted:
                nap = min(delay, max(self.room_at - time.monotonic(), self.job.poll_seconds))
                self.log.info(
                    "%s: %d row(s) wait for room in %s's queue (its limit: %s); %d row(s) wait "
                    "in %d provider batch(es); next look in %.0f s. %s",
                    self.label,
                    unsubmitted,
                    self.provider.name,
                    ", ".join(f"{k} {v:,}" for k, v in self.queue.limits().items()) or "not stated",
                    rows,
                    len(waiting),
                    nap,
                    self.progress_line(time.monotonic()),
                )
                self.stats.queue_wait_seconds += nap
            else:
                self.log.info(
                    "%s: %d row(s) wait in %d provider batch(es); next poll in %.0f s. %s",
                    self.label,
                    rows,
                    len(waiting),
                    nap,
                    self.progress_line(time.monotonic()),
                )
            time.sleep(nap)
            delay = min(delay * 2, self.job.max_poll_seconds)

    def _collect(self, s: Submission, status: Status) -> None:
        """Store the results of the ended submission ``s`` as one part, then mark it; its rows
        to send again go to the backlog (see the module docstring)."""
        assert s.batch_id is not None
        seen = [False] * len(s.ids)
        failed: list[_Failed] = []
        transient: list[int] = []  # indexes of requests that failed in a transient way
        to_online = self.job.way.mode is not Mode.batch  # rows without a result go online
        last = not to_online and s.attempt >= self.s.max_attempts
        if status.state is not State.FAILED:
            for result in self.provider.results(s.batch_id):
                index = index_of(result.custom_id, s.tag)
                if index is None or index >= len(s.ids):
                    continue  # not this submission's
                seen[index] = True
                if result.retry and result.error is not None and not last:
                    transient.append(index)
                else:
                    self._take(result, s.ids[index], s.hashes[index], failed)
        unrun = [i for i, got in enumerate(seen) if not got]
        if status.state is State.ENDED or (status.state is State.FAILED and not to_online) or last:
            for i in unrun:
                self._fail(s.ids[i], s.hashes[i], self._no_result(s, status), failed)
            unrun = []
        if self.spend is not None:  # its rows' results count now, at the batch price
            self.spend.release(self.reserved.pop(s.tag, 0.0))
        self.pending_failed.append(self._failures(failed))
        self._commit()
        self.sink.flush()
        assert isinstance(self.sink, PartWriter)
        self.sink.wait_for_writes()  # durable before the record says collected or returned
        back = [s.ids[i] for i in transient + unrun if s.ids[i] in self.attempts]
        self.queue.release(s.tag)  # it has left the queue
        if not back:
            self.records.advance(s, "collected")
            return
        for i in transient:  # each was a call the provider answered
            if s.ids[i] in self.attempts:
                self.attempts[s.ids[i]] += 1
        note = _returned(len(transient), len(unrun), status.state)
        if to_online:
            self.records.advance(s, "returned", note=note + "; finished online")
            self.log.info(
                "%s: provider batch %s: %s; finishing them online.", self.label, s.batch_id, note
            )
            self.handoff.take(self.attempts, back)
            return
        self.records.advance(s, "returned", note=note)
        self.log.warning(
            "%s: provider batch %s: %s; sending them again (attempt %d of %d).",
            self.label,
            s.batch_id,
            note,
            s.attempt + 1,
            self.s.max_attempts,
        )
        self._back(back, s.attempt + 1)

    def _no_result(self, s: Submission, status: Status) -> str:
        """Why a request of the ended submission ``s`` is a failed row without a result."""
        if status.state is State.FAILED:
            return f"the provider refused the batch {s.batch_id}: {status.detail or 'no detail'}"
        if status.state is State.ENDED:
            return f"the provider's batch {s.batch_id} ended without a result for this request"
        return (
            f"the provider's batch {s.batch_id} {status.state.value} before running this "
            f"request, at attempt {s.attempt} of max_attempts {self.s.max_attempts}"
        )

    def _take(self, result: Result, row_id: Any, input_hash: int, failed: list[_Failed]) -> None:
        """One request's result as a stored row (or a failed one); rows already stored (by a
        run that died before marking the submission collected) are skipped."""
        if result.error is not None or result.body is None:
            self._fail(row_id, input_hash, result.error or "no response body", failed)
            return
        if row_id not in self.attempts:
            self.stats.batch_results_dropped += 1  # stored already: never stored twice
            return
        answer = dumps(result.body) if self.job.keep_answers else None
        try:
            out = self.job.parse(result.body)
        except Exception as e:
            self._fail(row_id, input_hash, parse_error(e), failed, answer)
            return
        try:
            checked = self.check.row(out, row_id)
        except Broken as e:
            raise FunctionError(self.label, f"parse(): {e}", self.done_rows) from None
        if answer is not None:
            checked = {**checked, ANSWER: answer}
        attempts = self.attempts.pop(row_id)
        record = RowResult(checked, row_id, input_hash, attempts + 1)
        self.pending.append(record)
        self.pending_rows += 1
        if self.spend is not None:
            self.spend.add_record(record, batch=True)

    def _fail(
        self,
        row_id: Any,
        input_hash: int,
        why: str,
        failed: list[_Failed],
        answer: str | None = None,
    ) -> None:
        attempts = self.attempts.pop(row_id, None)
        if attempts is not None:  # else stored already
            failed.append((row_id, input_hash, why, attempts + 1, answer))
            self.last_error = why

    def _failures(self, failed: list[_Failed]) -> pl.DataFrame:
        ids, hashes, errors, attempts, answers = zip(*failed, strict=True) if failed else ((),) * 5
        columns = {
            self.id: pl.Series(list(ids), dtype=self.inputs.schema[self.id]),
            INPUT_HASH: pl.Series(list(hashes), dtype=pl.UInt64),
            ERROR: pl.Series(list(errors), dtype=pl.String),
            ATTEMPTS: pl.Series(list(attempts), dtype=pl.Int32),
        }
        if self.job.keep_answers:  # the body a parse() raised for; none for a refused request
            columns[ANSWER] = pl.Series(list(answers), dtype=pl.String)
        return pl.DataFrame(columns)


def _returned(transient: int, unrun: int, state: State) -> str:
    """What a returned submission's record says of its rows sent again."""
    said = [f"{transient} request(s) failed in a transient way"] if transient else []
    said += [f"{unrun} request(s) got no result: the batch {state.value}"] if unrun else []
    return "; ".join(said)
