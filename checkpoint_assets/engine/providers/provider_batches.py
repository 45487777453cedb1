"""Running a shard through a provider's batch API: submit its rows, wait or end, collect.

The user's per-row logic is two functions: ``request(row) -> dict`` (the request body) and
``parse(body) -> dict`` (output columns, usage columns among them).

:class:`ProviderRun` is a work loop beside :class:`~checkpoint_assets.engine.loop.runner.Run`,
both a ``ShardRun``. :func:`provider_loop` hands a job to ``runner.run()`` with this loop. The
lock, the plan (what is done, ``retry_failed``, dedupe), the sink's
parts, finalize, usage and the stop rules are the same as for computed rows. It re-attaches
and ends here; it submits as ``submitting.py`` says and collects as ``collecting.py`` says. Its
steps:

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

Modes (``Way.mode``, ``job.py``): ``hybrid`` and ``online`` hand rows to ``online.py``
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

import functools

import polars as pl

from checkpoint_assets.engine.calls.batches import Check
from checkpoint_assets.engine.errors import (
    BatchesPendingError,
    BudgetExceededError,
    CheckpointError,
)
from checkpoint_assets.engine.loop.shard_run import OwnLoop, RunContext
from checkpoint_assets.engine.loop.sink import PartWriter, Sink
from checkpoint_assets.engine.plan.inputs import Prepared
from checkpoint_assets.engine.plan.opening import Opened
from checkpoint_assets.engine.providers.answers import rederive
from checkpoint_assets.engine.providers.collecting import Collecting
from checkpoint_assets.engine.providers.handoff import Handoff
from checkpoint_assets.engine.providers.job import Mode, ProviderJob
from checkpoint_assets.engine.providers.queue import Claim, SharedQueue
from checkpoint_assets.engine.providers.submission_records import Records, Submission
from checkpoint_assets.engine.providers.submissions import Queue
from checkpoint_assets.engine.rows import ATTEMPTS
from checkpoint_assets.engine.settings import RunStats, Settings

_FIND_MARGIN_SECONDS = 600.0  # clocks differ: look for batches created a little before the intent


def provider_loop(job: ProviderJob) -> OwnLoop:
    """``job`` as ``runner.run()`` takes it: its shard runs on :class:`ProviderRun`."""
    return OwnLoop(functools.partial(ProviderRun, job))


class ProviderRun(Collecting):
    """A run whose rows go through a provider's batch API (see the module docstring)."""

    def __init__(
        self,
        job: ProviderJob,
        prepared: Prepared,
        settings: Settings,
        opened: Opened,
        sink: Sink,
        stats: RunStats,
        context: RunContext,
    ) -> None:
        super().__init__(prepared, settings, opened, sink, stats, context)
        self.job = job

    def work(self, todo: pl.DataFrame) -> CheckpointError | None:
        if not isinstance(self.sink, PartWriter):
            raise CheckpointError(
                f"{self.label}: provider batches need a checkpoint to record their submissions.",
                "Run with checkpointing on.",
            )
        self.stats.mode = self.job.way.mode.value
        self.provider = self.job.provider
        self.records = Records(self.sink.checkpoint.store, self.sink.checkpoint.files)
        self.check = Check(self.id)
        if self.opened.rederive is not None:
            again = self.job.recompute_unanswered
            todo = rederive(self, self.opened.rederive, self.job.parse, self.check, todo, again)
        self.todo = todo
        self.attempts = dict(
            zip(
                todo.get_column(self.id).to_list(), todo.get_column(ATTEMPTS).to_list(), strict=True
            )
        )
        self.reserved = {}
        self.refused = None
        self.handoff = Handoff(self, self.job)
        queue = getattr(self.provider, "queue", None)
        self.queue = SharedQueue(
            self.sink.checkpoint.store,
            queue if isinstance(queue, Queue) else Queue(self.provider.name),
            self._ended,
        )
        self.checkpoint_name = self.sink.checkpoint.name
        self.queue.forget_unsent(self.checkpoint_name)  # a stopped run's claims
        self.backlog = []  # rows without room yet wait here
        self.room_at = 0.0
        self.tokens_per_row = None
        self.noted_waiting = -1
        waiting = [s for s in self.records.load() if s.open and self._attach(s)]
        sent = {i for s in waiting for i in s.ids}
        fresh = todo.filter(~pl.col(self.id).is_in(list(sent))) if sent else todo
        if self.job.way.mode is Mode.online:
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
