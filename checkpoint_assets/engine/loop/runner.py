"""The run loop: one checkpointed run, free of Dagster.

``run()`` is the whole life of one run:

1. ``prepare()`` (inputs.py): validate ids and input columns. Hash every input row, a slice at
   a time, keeping only each row's id and hash.
2. ``open_run()`` (opening.py): take the lock, check the job, load what is stored, plan the rest.
3. ``Run.work``: read the rows to compute a slice at a time. Call the function on batches of
   ``batch_size`` rows, in threads or asyncio (for an ``async def``). Up to
   ``max_concurrency`` calls are in flight. Rate limits are throttle.py's; retries, poison rows,
   broken functions and outages are caller.py's. Results go to the sink (sink.py). It flushes
   every ``checkpoint_interval`` rows without holding up the calls. On any exception, SIGTERM
   or SIGINT, the run flushes what is done before leaving. No call starts once the lock is lost
   or the run is over (lock.py).
4. ``Run.close``: finalize through the sink, count the result, apply the stop rules (an outage,
   a broken function, a spent quota, too many failed rows).

Here: ``run()`` and ``Run``, the work loop that calls the function. What every
work loop shares (the hand-over of rows done to the sink, progress, ``close``) is ``ShardRun``'s,
in shard_run.py. Work that brings its own loop (``provider_batches.ProviderRun``) comes to
``run()`` as an ``OwnLoop``, which starts that loop in place of ``Run``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls import workers
from checkpoint_assets.engine.calls.batches import Batch, PerRow, height
from checkpoint_assets.engine.calls.budget import Spend
from checkpoint_assets.engine.calls.caller import BatchFn, Caller, Outcome
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import (
    BudgetExceededError,
    CheckpointError,
    FunctionError,
    OutageError,
    QuotaExhaustedError,
)
from checkpoint_assets.engine.loop.lock import Lease
from checkpoint_assets.engine.loop.shard_run import OwnLoop, RunContext, ShardRun
from checkpoint_assets.engine.loop.sink import MemorySink, PartWriter, Sink
from checkpoint_assets.engine.plan.inputs import CONTENT_LO, Prepared, prepare
from checkpoint_assets.engine.plan.opening import Opened, open_run
from checkpoint_assets.engine.plan.resume import DEDUPE_KEY
from checkpoint_assets.engine.plan.start import Job
from checkpoint_assets.engine.reuse.contribution import Contribution
from checkpoint_assets.engine.rows import ERROR, INPUT_HASH
from checkpoint_assets.engine.settings import RunStats, Settings
from checkpoint_assets.engine.sharding import hashing

__all__ = ["OwnLoop", "Prepared", "Run", "RunContext", "prepare", "run"]


def run(
    fn: BatchFn | PerRow | OwnLoop,
    inputs: Prepared,
    checkpoint: Checkpoint | None,
    settings: Settings,
    *,
    job: Mapping[str, Any],
    context: RunContext | None = None,
) -> tuple[pl.DataFrame, RunStats]:
    """Run ``fn`` over ``inputs`` (from ``prepare()``) with resume and checkpointing.

    ``fn`` takes a frame of rows, or one row as a dict when wrapped in :class:`PerRow` (one row
    per call then: ``batch_size`` must be unset or 1). An :class:`OwnLoop` (a provider job,
    ``provider_batches.provider_loop``) starts its own work loop instead of ``Run``.
    Returns the result (id, outputs, ``_error``; one row per input id) and the run's stats.
    With ``checkpointing`` off, ``checkpoint`` is ignored and nothing is read or written.
    ``job``: the settings that change results (their fingerprint identifies the job).
    ``context``: where and how the shard runs (its rule, lock watch, log, global resume rows,
    function fingerprint, spend, result store; see :class:`RunContext`). Rows ``imported`` whose
    id and input hash match a row of ``inputs`` are copied into this checkpoint and skipped.
    The checkpoint may hold another function fingerprint under the same job. The run then
    warns (once its stored results are reused) and reports it in ``stats``. When the run
    finishes, the checkpoint records this one. No call starts once ``spend`` reaches a limit
    (see engine/calls/budget.py).
    """
    context = context or RunContext()
    if context.results is not None and CONTENT_LO not in inputs.keys.columns:
        raise ValueError("A run with a result store needs rows prepared with content=True.")
    if isinstance(fn, PerRow):
        settings = _one_row_per_call(settings, context.label)
    if context.spend is None and settings.budget is not None:
        context = dataclasses.replace(context, spend=Spend(settings.budget, label=context.name))
    stats = RunStats(rows_total=inputs.keys.height)
    stats.input_fingerprint = hashing.fingerprint(inputs.keys.get_column(INPUT_HASH).to_numpy())
    shard = _Shard(fn, inputs, settings, job, context, stats)
    if not settings.checkpointing:
        return shard.without_checkpoint()
    if checkpoint is None:
        raise ValueError("A run with checkpointing needs a checkpoint (or checkpointing=False).")
    return shard.on(checkpoint)


@dataclass(frozen=True)
class _Shard:
    """One shard's run, up to its work loop: the lock, the opening and the sink."""

    fn: BatchFn | PerRow | OwnLoop
    inputs: Prepared
    settings: Settings
    job: Mapping[str, Any]
    context: RunContext
    stats: RunStats

    def without_checkpoint(self) -> tuple[pl.DataFrame, RunStats]:
        return self._work(self._open(None), MemorySink(self.settings))

    def on(self, checkpoint: Checkpoint) -> tuple[pl.DataFrame, RunStats]:
        """The run on ``checkpoint``, under its lock."""
        s, context = self.settings, self.context
        self.stats.checkpoint_path = checkpoint.url
        lease = Lease(
            checkpoint.store,
            checkpoint.files.lock,
            run_id=context.run_id,
            lease_seconds=s.lease_seconds,
            watch=context.watch,
            logger=context.log,
        )
        before = checkpoint.store.usage()  # a ranged run's shards share one store
        lease.acquire()
        try:
            opened = self._open(checkpoint)
            sink = PartWriter(
                checkpoint,
                opened,
                lease,
                s,
                # A re-derived parse carries rows computed by the earlier one: none is added.
                contribution=self._contribution() if opened.rederive is None else None,
            )
            return self._work(opened, sink)
        finally:
            lease.release()
            self.stats.requests = dict(checkpoint.store.usage().since(before).requests)

    def _open(self, checkpoint: Checkpoint | None) -> Opened:
        context = self.context
        printed = context.function_fingerprint
        return open_run(
            self.inputs,
            self.settings,
            checkpoint,
            job=Job(dict(self.job), dict(printed) if printed else None, context.parse),
            scheme=context.scheme,
            imported=context.imported if checkpoint is not None else None,
            log=context.log,
            label=context.name,
            results=context.results if checkpoint is not None else None,
        )

    def _contribution(self) -> Contribution | None:
        """What the shard adds to the result store, when it has one (and a fingerprint)."""
        results, printed = self.context.results, self.context.function_fingerprint
        if results is None or not printed:
            return None
        return Contribution(
            results,
            Job(dict(self.job), dict(printed), self.context.parse).scope,
            self.inputs.keys,
            id_column=self.settings.id_column,
            hi=DEDUPE_KEY,
            lo=CONTENT_LO,
            log=self.context.log,
        )

    def _work(self, opened: Opened, sink: Sink) -> tuple[pl.DataFrame, RunStats]:
        loop: ShardRun
        if isinstance(self.fn, OwnLoop):
            loop = self.fn.start(self.inputs, self.settings, opened, sink, self.stats, self.context)
        else:
            loop = Run(self.fn, self.inputs, self.settings, opened, sink, self.stats, self.context)
        return loop.execute()


def _one_row_per_call(settings: Settings, label: str) -> Settings:
    if settings.batch_size not in (None, 1):
        raise CheckpointError(
            f"{label or 'checkpoint'}: batch_size={settings.batch_size}, but the function takes "
            "one row (a dict) per call.",
            "Leave batch_size unset for a per-row function, or take a frame of rows "
            "(annotate the first parameter as pl.DataFrame).",
        )
    return dataclasses.replace(settings, batch_size=1)


class Run(ShardRun):
    """The work loop that calls the function: dispatch batches, absorb their outcomes, hand the
    rows done to the sink when a flush is due."""

    suspect: list[pl.DataFrame]  # failures that an outage may still disown

    def __init__(
        self,
        fn: BatchFn | PerRow,
        prepared: Prepared,
        settings: Settings,
        opened: Opened,
        sink: Sink,
        stats: RunStats,
        context: RunContext,
    ) -> None:
        super().__init__(prepared, settings, opened, sink, stats, context)
        self.fn = fn

    def work(self, todo: pl.DataFrame) -> CheckpointError | None:
        """Process ``todo``; returns why the shard stopped early, or None."""
        self.suspect = []
        caller = Caller(
            self.fn, self.s, throttle=self.throttle, spend=self.spend, halt=self.sink.halted
        )
        try:
            for outcomes in self._outcomes(caller, todo):
                for outcome in outcomes:  # a flush may fall due after any of them: the bound
                    self._absorb([outcome], outage=caller.outage)
                    self._settle()
                self._maybe_progress()
        finally:
            caller.close()
        if caller.outage:
            # Failures seen during an outage say nothing about the rows; results of calls
            # that succeeded before it (batches still in flight) are kept.
            self.suspect.clear()
        self.pending_failed += self.suspect
        self.suspect = []
        self._commit()
        halted = self.sink.halt_error(self.label, self.done_rows)
        if halted is not None:
            return halted
        if caller.quota is not None:
            return QuotaExhaustedError(self.label, caller.quota, self.done_rows, stated=True)
        if caller.broken is not None:
            return FunctionError(self.label, caller.broken, self.done_rows)
        if caller.outage:
            last = caller.last_error or "every call failed"
            return OutageError(self.label, caller.outage_after, last, self.done_rows)
        spent = self.throttle.quota_spent
        if spent is not None:
            return QuotaExhaustedError(self.label, spent, self.done_rows)
        return self._over_budget()

    def _over_budget(self) -> CheckpointError | None:
        """Why the budget stopped the shard, once its rows done are handed to the sink."""
        if self.spend is None:
            return None
        if self.spend.problem is not None:
            return self.spend.problem
        over = self.spend.reached()
        if over is None or self.done_rows >= self.todo_rows:
            return None  # the last call reached the limit: nothing was left undone
        return BudgetExceededError(self.label, over.name, over.limit, over.spent, self.done_rows)

    def _outcomes(self, caller: Caller, todo: pl.DataFrame) -> Iterator[list[Outcome]]:
        """The outcomes of the batches, as many at a time as are ready.

        The input rows of ``todo`` are read a slice at a time as the batches are taken
        (inputs.py).
        """
        size = self.s.batch_rows
        batches = (
            batch for rows in self.prepared.todo(todo, size) for batch in caller.batches(rows, size)
        )
        if self.s.max_concurrency <= 1:
            for batch in batches:
                yield [caller.process(batch)]
                if caller.stopping:
                    return
            return
        yield from self._concurrently(caller, batches)

    def _concurrently(self, caller: Caller, batches: Iterator[Batch]) -> Iterator[list[Outcome]]:
        """``max_concurrency`` workers take batches and call the function; their outcomes come
        back here, to the one thread that hands results to the sink, several at a time (see
        workers.py). The shard's throttle decides how many of them may call the function at a
        time (fewer while the endpoint rate limits)."""
        handoff = workers.start(caller, batches, self.s.max_concurrency, self.s.batches_held)
        running = self.s.max_concurrency
        try:
            while running:
                items = handoff.wait(self._poll_seconds())
                if not items:
                    self._settle()  # a flush may be due by time, or the writer free
                    continue
                outcomes = [i for i in items if isinstance(i, Outcome)]
                running -= items.count(None)
                if outcomes:
                    yield outcomes
                # The batches' slots (at a worker's end, its own), once their outcomes are
                # absorbed: until then they count in the loss bound's calls held.
                handoff.release(len(items))
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
        finally:
            handoff.leave()  # on an exception or a stop: finish the calls in flight, take no more

    def _poll_seconds(self) -> float:
        """How long to wait for a call before looking at the sink again.

        Briefly while rows wait for the writer to be free, else until a time-based flush could
        be due.
        """
        waiting = self.pending_rows or self.sink.buffered_rows
        return 0.05 if waiting else self.s.flush_seconds

    def _absorb(self, outcomes: list[Outcome], *, outage: bool) -> None:
        for outcome in outcomes:
            self.stats.calls += outcome.calls
            self.stats.failed_calls += outcome.failed_calls
            self.stats.throttled_calls += outcome.throttled_calls
            if outage:
                # Failures seen during an outage say nothing about the rows; results of calls
                # that succeeded before it (batches still in flight) are kept.
                self.suspect.clear()
                outcome.failed.clear()
            if outcome.failed:
                self.last_error = str(outcome.failed[-1].get_column(ERROR)[-1])
            if not outcome.ok:
                self.suspect.extend(outcome.failed)  # until a success shows the endpoint works
                continue
            self.pending.extend(outcome.ok)
            self.pending_rows += sum(height(r) for r in outcome.ok)
            for failed in (self.suspect, outcome.failed):
                self.pending_failed.extend(failed)
                self.pending_rows += sum(f.height for f in failed)
            self.suspect = []

    def _settle(self) -> None:
        """Hand the rows done to the sink when a flush of them is due.

        The first result goes at once: its output columns must be storable before more calls
        are paid for.
        """
        if self.sink.due(self.pending_rows):
            self._commit()
            self.sink.flush()
        elif self.pending and self.sink.outputs is None:
            self._commit()
