"""Running a shard through a provider's batch API: submit its rows, wait or end, collect.

The user's per-row logic is two functions: ``request(row) -> dict`` (the request body) and
``parse(body) -> dict`` (output columns, usage columns among them).

:class:`ProviderRun` is a work loop beside :class:`~checkpoint_assets.engine.loop.runner.Run`,
both a ``ShardRun``. The lock, the plan (what is done, ``retry_failed``, dedupe), the sink's
parts, finalize, usage and the stop rules are the same as for computed rows. Its steps:

1. **Re-attach** the open submission records of the checkpoint (``submission_records.py``).
   Those with a batch id are polled; the others are found on the provider by their tag.
2. **Submit** the rows to do that no open submission holds, split within the provider's limits
   and the room left in its queue, shared with every shard that submits to it (``queue.py``).
   Each submission is recorded (intent) before its upload; its file and batch ids are recorded
   as they come. Rows without room yet wait in the run and are submitted as batches end.
3. **Collect**, polling with backoff (``poll_seconds`` doubling up to ``max_poll_seconds``). A
   submission that ended is downloaded, parsed and stored as one part. It is then marked
   collected, or returned when some of its rows are sent again (below).
4. **Send again** the rows left without a result while their attempt is below ``max_attempts``:
   - rows whose request failed in a transient way (the adapter's ``Result.retry``: a server
     error, an overload, a rate limit);
   - rows that an expiry or a cancel left without a result.

   Each submission records its attempt (1 for fresh rows). Its rows sent again go in a new
   submission of the next attempt. That one is recorded after the part of the results it had
   is durable and the old one is marked returned. Other per-request errors (an invalid
   request) are failed rows at once. So are transient ones at the last attempt; the next run
   computes them again while ``retry_failed`` is on.
5. **End**, with ``wait`` off, as soon as the submissions that had room are created and what had
   ended is collected. The run ends with :class:`BatchesPendingError`, the shard unfinished; it
   says how many rows still wait for room in the queue, for the run that submits them.

Queue room. A submission the provider refuses for want of room in its queue
(``submissions.QueueFull``, or a poll in state ``REFUSED``) is no failure: nothing of it ran or is
billed. It is recorded as refused, the limit its refusal states is written down for every shard,
and its rows wait, at the same attempt, until the queue has room: this shard's batches or
others' end, or the time the provider asked passes. Such refusals make no failed row and are
not attempts.

Answers. Each collected row keeps its response body in ``_answer`` (``keep_answers``). When
``parse`` changed since the stored rows were computed, the run first parses their answers again,
with no request (``answers.py``). Finished rows without one keep their outputs unless
``recompute_unanswered``.

Modes (``ProviderJob.mode``, ``job.py``): ``hybrid`` and ``online`` hand rows to ``online.py``
(``handoff.py``).

No row goes online while a batch that holds it may still answer, so no row is paid twice. A
batch result whose row is stored already (after a crash, a submission collected again) is
dropped and counted (``RunStats.batch_results_dropped``).

Spend budget. Before a submission is recorded or sent, its estimated cost is reserved in the
run's spend (``splits.py`` says how it is estimated and what a refusal does).

Loss bound. A hard kill loses no paid request. Every submission is recorded before anything is
sent, and its results stay on the provider (OpenAI: 30 days; Anthropic: 29) until a run stores
them. A kill costs the work of the step that was under way:

- one upload again, after a kill between the upload and its record;
- one download again, after a kill before a collected part is durable or before its submission
  is marked collected. Then only the rows not stored yet are stored.
"""

from __future__ import annotations

import json
import time
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls.batches import Broken, Check, RowResult
from checkpoint_assets.engine.calls.refusals import quota_spent
from checkpoint_assets.engine.errors import (
    BatchesPendingError,
    BudgetExceededError,
    CheckpointError,
    FunctionError,
    QuotaExhaustedError,
)
from checkpoint_assets.engine.loop.shard_run import ShardRun
from checkpoint_assets.engine.loop.sink import PartWriter
from checkpoint_assets.engine.providers.answers import ANSWER, dumps, parse_error, rederive
from checkpoint_assets.engine.providers.handoff import Handoff
from checkpoint_assets.engine.providers.job import Mode, ProviderJob
from checkpoint_assets.engine.providers.queue import Claim, SharedQueue, Use, enough, kind_of
from checkpoint_assets.engine.providers.splits import Room, Split, rows_of, splits
from checkpoint_assets.engine.providers.submission_records import Records, Submission
from checkpoint_assets.engine.providers.submissions import (
    CONCURRENT_JOBS,
    ENQUEUED_TOKENS,
    QUEUED_REQUESTS,
    WINDOW_SECONDS,
    Queue,
    QueueFull,
    Result,
    State,
    Status,
    index_of,
)
from checkpoint_assets.engine.rows import ATTEMPTS, ERROR, INPUT_HASH

_FIND_MARGIN_SECONDS = 600.0  # clocks differ: look for batches created a little before the intent


# A failed row: id, input hash, error, attempts, answer (None: none kept).
_Failed = tuple[Any, int, str, int, str | None]


class ProviderRun(ShardRun):
    """A run whose rows go through a provider's batch API (see the module docstring)."""

    job: ProviderJob

    def work(self, todo: pl.DataFrame) -> CheckpointError | None:
        if not isinstance(self.fn, ProviderJob) or not isinstance(self.sink, PartWriter):
            raise CheckpointError(
                f"{self.label}: provider batches need a checkpoint to record their submissions.",
                "Run with checkpointing on.",
            )
        self.job = self.fn
        self.stats.mode = self.job.mode.value
        self.provider = self.job.provider
        self.records = Records(self.sink.checkpoint.store, self.sink.checkpoint.files)
        self.check = Check(self.id)
        if self.opened.rederive is not None:
            again = self.job.recompute_unanswered
            todo = rederive(self, self.opened.rederive, self.job.parse, self.check, todo, again)
        # Keys (id, input hash, position): rows are read as submissions or online calls take them.
        self.todo = todo
        # The rows to do that no collected result covers yet, with their calls so far.
        self.attempts: dict[Any, int] = dict(
            zip(
                todo.get_column(self.id).to_list(), todo.get_column(ATTEMPTS).to_list(), strict=True
            )
        )
        self.reserved: dict[str, float] = {}  # the estimates of this run's submissions, by tag
        self.refused: BudgetExceededError | None = None  # a submission the budget did not take
        self.handoff = Handoff(self, self.job)  # rows finished online, batches cancelled
        queue = getattr(self.provider, "queue", None)
        self.queue = SharedQueue(
            self.sink.checkpoint.store,
            queue if isinstance(queue, Queue) else Queue(self.provider.name),
            self._ended,
        )
        self.checkpoint_name = self.sink.checkpoint.name
        # Rows to submit (keys) and their attempt, oldest first: those without room yet wait here.
        self.backlog: list[tuple[pl.DataFrame, int]] = []
        self.room_at = 0.0  # no submission before this time (monotonic): a refusal asked to wait
        self.tokens_per_row: float | None = None  # of the submissions made, for the room needed
        self.noted_waiting = -1  # the rows waiting for room last recorded (-1: unknown)
        waiting = [s for s in self.records.load() if s.open and self._attach(s)]
        sent = {i for s in waiting for i in s.ids}
        fresh = todo.filter(~pl.col(self.id).is_in(list(sent))) if sent else todo
        if self.job.mode is Mode.online:
            self.handoff.take(self.attempts, fresh.get_column(self.id).to_list())
        elif fresh.height:
            self.backlog.append((fresh, 1))
            waiting += self._submit_backlog()
        pending = self._collect_all(waiting)
        self.stats.rows_waiting_for_queue = self._unsubmitted()
        self._note_waiting(self.stats.rows_waiting_for_queue)
        self.stats.queue_use = round(self.queue.peak, 3) if self.queue.limits() else None
        if self.spend is not None and self.spend.problem is not None:
            return self.spend.problem  # a result whose cost is unknown
        return self._over_budget_of(pending) if self.refused is not None else pending

    # -- submitting ----------------------------------------------------------------------
    def _attach(self, s: Submission) -> bool:
        """Make sure the open submission ``s`` has its batch; False when it never reached the
        provider (its rows are then submitted again)."""
        if s.batch_id is None:
            found = self.provider.find(s.tag, s.created_at - _FIND_MARGIN_SECONDS)
            if found is None and s.file_id is not None:
                found = self.provider.create([], s.file_id, s.tag)
            if found is None:
                note = "the run that submitted it stopped before anything reached the provider"
                self.records.advance(s, "dropped", note=note)
                return False
            self.records.advance(s, "created", batch_id=found)
        self.queue.hold(
            Claim(s.tag, self.checkpoint_name, s.tokens, len(s.ids), batch_id=s.batch_id)
        )
        self.log.info(
            "%s: re-attached to provider batch %s (%d rows): nothing is submitted again.",
            self.label,
            s.batch_id,
            len(s.ids),
        )
        return True

    def _submit_backlog(self) -> list[Submission]:
        """Submit the rows of the backlog that the provider's limits and its queue's room take,
        oldest first, until the room or the spend budget runs out (see the module docstring)."""
        made: list[Submission] = []
        while self.backlog and self.refused is None:
            keys, attempt = self.backlog[0]
            keys = keys.filter(pl.col(self.id).is_in(list(self.attempts)))  # not stored since
            if keys.height == 0:
                self.backlog.pop(0)
                continue
            room = self._room(keys.height)
            if room is None:
                break
            sent: list[Any] = []
            for split in splits(
                self.provider, rows_of(self.prepared, keys), self._body, self.id, room
            ):
                s = self._claimed_send(split, attempt)
                if s is None:
                    break
                made.append(s)
                sent += split.ids
                per_row = split.tokens / len(split.ids)
                self.tokens_per_row = max(self.tokens_per_row or 0.0, per_row)
            left = keys.filter(~pl.col(self.id).is_in(sent)) if sent else keys
            if left.height:
                self.backlog[0] = (left, attempt)
                break  # the room, or the budget, ran out before these rows
            self.backlog.pop(0)
        return made

    def _room(self, rows: int) -> Room | None:
        """The room the next submissions of ``rows`` rows may take in the provider's queue, or
        None when they should wait (too little room, or a refusal asked to wait)."""
        if time.monotonic() < self.room_at:
            return None
        claims = self.queue.claims()
        limits = self.queue.limits()
        if not limits:
            return Room()  # unknown: the claims take turns until a refusal states the limit
        tokens = self.tokens_per_row
        need = Use(rows * int(tokens + 1) if tokens else 2**62, rows, 1)
        room = self.queue.room(claims)
        assert room is not None
        if not enough(room, limits, need):
            # Room frees when batches end, not when collected: poll the batches of the claims.
            claims = self.queue.claims(poll=True)
            room = self.queue.room(claims)
            assert room is not None
            if not enough(room, limits, need):
                return None
        return Room(room.get(QUEUED_REQUESTS), room.get(ENQUEUED_TOKENS), room.get(CONCURRENT_JOBS))

    def _claimed_send(self, split: Split, attempt: int) -> Submission | None:
        """Claim ``split``'s room in the queue, reserve its cost, send it; None when the queue or
        the budget has no room for it (it stays in the backlog)."""
        claim = Claim(split.tag, self.checkpoint_name, split.tokens, len(split.requests))
        if not self.queue.take(claim):
            self.room_at = time.monotonic() + self.queue.step_back()
            return None
        if not self._reserve(split):
            self.queue.release(split.tag)
            return None
        tag, requests = split.tag, split.requests
        s = Submission(
            tag, self.provider.name, split.ids, split.hashes, attempt=attempt, tokens=split.tokens
        )
        self.records.record_intent(s)
        try:
            file_id = self.provider.upload(requests, tag)
            if file_id is not None:
                self.records.advance(s, "uploaded", file_id=file_id)
            batch_id = self.provider.create(requests, file_id, tag)
        except QueueFull as e:
            self._refused(s, e)
            return None
        except Exception as e:
            spent = quota_spent(e)
            if spent is None:
                raise
            # Its record stays open: the next run finds or creates its batch.
            self.queue.release(split.tag)
            raise QuotaExhaustedError(self.label, spent, self.done_rows, stated=True) from e
        self.records.advance(s, "created", batch_id=batch_id)
        self.queue.created(claim, batch_id)
        self.stats.calls += len(requests)
        self.log.info(
            "%s: submitted %d rows to %s as batch %s (submission %s).",
            self.label,
            len(requests),
            self.provider.name,
            batch_id,
            tag,
        )
        return s

    def _refused(self, s: Submission, refusal: QueueFull) -> None:
        """The provider had no room for ``s`` in its queue: record it refused (nothing ran, nothing
        is billed), free its claim and reservation, and write down what the refusal says."""
        self.records.advance(s, "refused", note=refusal.message)
        # What it teaches is written before its claim goes, so no shard sends into the gap.
        used = self.queue.used([c for c in self.queue.claims() if c.tag != s.tag])
        learned = self.queue.learn(refusal, kind_of(refusal, self.queue.queue), used)
        self.queue.release(s.tag)
        if self.spend is not None:
            self.spend.release(self.reserved.pop(s.tag, 0.0))
        self.stats.submissions_refused += 1
        wait = refusal.retry_after if refusal.retry_after is not None else 0.0
        if not learned and not self.queue.limits():
            wait = max(wait, self.job.poll_seconds)  # nothing known of the queue: wait a while
        self.room_at = max(self.room_at, time.monotonic() + wait)
        known = ", ".join(f"{k} {v:,}" for k, v in self.queue.limits().items()) or "not stated"
        self.log.warning(
            "%s: %s had no room in its queue for submission %s (%d rows): %s. Nothing of it ran "
            "or is billed; its rows are submitted again once the queue has room (its limit: %s).",
            self.label,
            self.provider.name,
            s.tag,
            len(s.ids),
            refusal.message.rstrip(". "),
            known,
        )

    def _ended(self, batch_id: str) -> bool:
        """Whether ``batch_id`` (any shard's) has left the queue; False when the poll fails."""
        try:
            return self.provider.poll(batch_id).state is not State.RUNNING
        except Exception:
            return False

    def _reserve(self, split: Split) -> bool:
        """Reserve the estimated cost of ``split`` in the spend budget; False when it does not
        fit (``refused`` says why)."""
        if self.spend is None:
            return True
        # The adapters in resources/ complete each body with their resource's defaults (model,
        # max_tokens); the protocol does not require them.
        defaults = getattr(self.provider, "defaults", None) or {}
        estimate = split.estimate(self.spend.budget, defaults)
        try:
            self.spend.reserve(estimate)
        except BudgetExceededError as e:
            self.refused = e
            self.refused.estimate = estimate
            return False
        self.reserved[split.tag] = estimate
        return True

    def _over_budget_of(self, pending: CheckpointError | None) -> BudgetExceededError:
        """The run's end when the budget refused a submission: what was spent and is still
        reserved, against the limit it would have passed."""
        assert self.refused is not None and self.spend is not None
        name, limit = self.refused.limit_name, self.refused.limit
        before = self.spend.asset_spent_before if name == "max_asset_cost" else 0.0
        rows = pending.rows if isinstance(pending, BatchesPendingError) else 0
        return BudgetExceededError(
            self.label,
            name,
            limit,
            before + self.spend.spent,
            self.done_rows,
            estimate=self.refused.estimate,
            reserved=self.spend.reserved,
            pending=rows,
        )

    def _body(self, row: dict[str, Any]) -> dict[str, Any]:
        try:
            body = self.job.request(row)
        except Exception as e:
            problem = f"request() raised {type(e).__name__}: {e} for the row {row[self.id]!r}"
            raise FunctionError(self.label, problem, self.done_rows) from e
        if not isinstance(body, dict):
            problem = f"request() returned {type(body).__name__}; it must return a dict (the body)"
            raise FunctionError(self.label, problem, self.done_rows)
        return body

    # -- collecting ----------------------------------------------------------------------
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
            if self.backlog and self.job.mode is Mode.hybrid and self.handoff.past_deadline():
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
            if not self.job.wait and self.job.mode is Mode.batch:
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

    def _note_waiting(self, rows: int) -> None:
        """Record in the checkpoint how many rows wait for queue room (``checkpoint-assets
        status`` shows it); nothing is written while the count stays the same."""
        if rows == self.noted_waiting:
            return
        store, path = self.records.store, self.records.files.queue_waiting
        if rows:
            store.put(path, json.dumps({"rows": rows, "at": time.time()}).encode())
        else:
            store.delete([path])
        self.noted_waiting = rows

    def _unsubmitted(self) -> int:
        """Rows of the backlog still to submit (none once the budget refused a submission)."""
        if self.refused is not None:
            return 0
        return sum(keys.height for keys, _ in self.backlog)

    def _back(self, ids: list[Any], attempt: int) -> None:
        """Put the rows ``ids`` (those not stored) back in the backlog at ``attempt``."""
        ids = [i for i in ids if i in self.attempts]
        keys = self.todo.filter(pl.col(self.id).is_in(ids))
        if keys.height:
            self.backlog.append((keys, attempt))

    def _collect(self, s: Submission, status: Status) -> None:
        """Store the results of the ended submission ``s`` as one part, then mark it; its rows
        to send again go to the backlog (see the module docstring)."""
        assert s.batch_id is not None
        seen = [False] * len(s.ids)
        failed: list[_Failed] = []
        transient: list[int] = []  # indexes of requests that failed in a transient way
        to_online = self.job.mode is not Mode.batch  # rows without a result go online
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
