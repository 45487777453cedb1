"""The run loop: one checkpointed run, free of Dagster.

``run()`` is the whole life of one run::

    prepare()    validate ids and input columns, hash every input row
    open_run()   take the lock, check the job, load what is stored, plan the rest (opening.py)
    Run.work     call the function on batches of ``batch_size`` rows (threads, or asyncio for an
                 ``async def``, up to ``max_concurrency`` in flight; rate limits in throttle.py;
                 retries, poison rows, broken functions and outages in caller.py) and hand
                 results to the sink, which flushes every ``checkpoint_interval`` rows without
                 holding up the calls (sink.py); on any exception, SIGTERM or SIGINT, flush what
                 is done before leaving; no call starts once the lock is lost or the run is over
                 (lock.py)
    Run.close    finalize through the sink, count the result, apply the stop rules (an outage,
                 a broken function, a spent quota, too many failed rows)

Here: ``prepare()``, ``run()`` and ``Run``, the work loop that calls the function. What every
work loop shares (the hand-over of rows done to the sink, progress, ``close``) is ``ShardRun``'s,
in shard_run.py; ``provider_batches.ProviderRun`` is the other work loop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls import workers
from checkpoint_assets.engine.calls.batches import Batch, PerRow, height
from checkpoint_assets.engine.calls.budget import Spend
from checkpoint_assets.engine.calls.caller import BatchFn, Caller, Outcome, outage_threshold
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import (
    BudgetExceededError,
    CheckpointError,
    FunctionError,
    MissingColumnsError,
    OutageError,
    QuotaExhaustedError,
)
from checkpoint_assets.engine.loop.lock import Lease, RunWatch
from checkpoint_assets.engine.loop.shard_run import ShardRun
from checkpoint_assets.engine.loop.sink import Logger, MemorySink, PartWriter, Sink
from checkpoint_assets.engine.plan.opening import Job, Opened, open_run
from checkpoint_assets.engine.plan.resume import canonical_ids, validate_ids
from checkpoint_assets.engine.rows import ERROR, INPUT_HASH
from checkpoint_assets.engine.settings import RunStats, Settings
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.scheme import Scheme


def prepare(df: pl.DataFrame, settings: Settings) -> pl.DataFrame:
    """Validate ids and return id + input columns with each row's ``_input_hash``."""
    validate_ids(df, settings.id_column)
    missing = [c for c in settings.input_columns if c not in df.columns]
    if missing:
        raise MissingColumnsError(missing, df.columns)
    columns = [settings.id_column, *settings.input_columns]
    frame = canonical_ids(df.select(columns), settings.id_column)
    hashes = hashing.row_hashes(frame, columns)
    return frame.with_columns(pl.Series(INPUT_HASH, hashes, dtype=pl.UInt64))


def run(
    fn: BatchFn | PerRow | Any,  # Any: what ``loop`` takes
    inputs: pl.DataFrame,
    checkpoint: Checkpoint | None,
    settings: Settings,
    *,
    job: Mapping[str, Any],
    scheme: Scheme | None = None,
    run_id: str | None = None,
    watch: RunWatch | None = None,
    logger: Logger | None = None,
    label: str = "",
    imported: pl.DataFrame | None = None,
    function_fingerprint: Mapping[str, str] | None = None,
    spend: Spend | None = None,
    loop: type[ShardRun] | None = None,
) -> tuple[pl.DataFrame, RunStats]:
    """Run ``fn`` over ``inputs`` (already ``prepare()``d) with resume and checkpointing.

    ``fn`` takes a frame of rows, or one row as a dict when wrapped in :class:`PerRow` (one row
    per call then: ``batch_size`` must be unset or 1).
    Returns the result (id, outputs, ``_error``; one row per input id) and the run's stats.
    With ``checkpointing`` off, ``checkpoint`` is ignored and nothing is read or written.
    ``job``: the settings that change results (their fingerprint identifies the job).
    ``imported``: finished rows from other checkpoints of the same job (global resume); those
    whose id and input hash match a row of ``inputs`` are copied into this checkpoint and skipped.
    ``function_fingerprint``: the fingerprint of ``fn`` (``function_fingerprint.of_function``,
    merged with ``of_resources``). When the checkpoint recorded another one under the same job,
    the run warns (once its stored results are reused) and reports it in ``stats``; when it
    finishes, the checkpoint records this one. None: nothing is compared or recorded.
    ``spend``: the tally of ``settings.budget`` this run adds to (shared by the shards of one
    run; default: a new one); no call starts once it reaches a limit (see engine/calls/budget.py).
    ``watch``: what the lock's heartbeat asks about runs: whether this one should stop (its run
    is over, its launcher gone), how a live holder's run ended, a dead holder taken over (see
    ``lock.py``).
    ``loop``: the work loop, ``Run`` by default (``provider_batches.ProviderRun`` sends the rows
    of a ``ProviderJob`` through a provider's batch API instead of calling ``fn``).
    """
    log = logger or logging.getLogger("checkpoint_assets")
    work: type[ShardRun] = loop or Run
    if isinstance(fn, PerRow):
        settings = _one_row_per_call(settings, label)
    stats = RunStats(rows_total=inputs.height)
    stats.input_fingerprint = hashing.fingerprint(inputs.get_column(INPUT_HASH).to_numpy())
    label = label or "checkpoint"
    if spend is None and settings.budget is not None:
        spend = Spend(settings.budget, label=label)

    def start(at: Checkpoint | None) -> Opened:
        found = imported if at is not None else None
        return open_run(
            inputs,
            settings,
            at,
            job=Job(dict(job), dict(function_fingerprint) if function_fingerprint else None),
            scheme=scheme,
            imported=found,
            log=log,
            label=label,
        )

    if not settings.checkpointing:
        opened = start(None)
        sink: Sink = MemorySink(
            settings.id_column,
            interval=settings.checkpoint_interval,
            flush_seconds=settings.flush_seconds,
        )
        return work(fn, inputs, settings, opened, sink, stats, log, label, spend).execute()
    if checkpoint is None:
        raise ValueError("A run with checkpointing needs a checkpoint (or checkpointing=False).")
    stats.checkpoint_path = checkpoint.url
    lease = Lease(
        checkpoint.store,
        checkpoint.files.lock,
        run_id=run_id,
        lease_seconds=settings.lease_seconds,
        watch=watch,
        logger=log,
    )
    before = checkpoint.store.usage()  # a ranged run's shards share one store
    lease.acquire()
    try:
        opened = start(checkpoint)
        min_flush = settings.min_flush_seconds
        sink = PartWriter(
            checkpoint,
            opened,
            lease,
            settings.id_column,
            interval=settings.checkpoint_interval,
            flush_seconds=settings.flush_seconds,
            min_flush_seconds=checkpoint.store.min_flush_seconds
            if min_flush is None
            else min_flush,
            max_unflushed=settings.max_unflushed_rows,
        )
        return work(fn, inputs, settings, opened, sink, stats, log, label, spend).execute()
    finally:
        lease.release()
        stats.requests = dict(checkpoint.store.usage().since(before).requests)


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

    def work(self, todo: pl.DataFrame) -> CheckpointError | None:
        """Process ``todo``; returns why the shard stopped early, or None."""
        self.suspect = []
        outage_at = outage_threshold(self.s.max_attempts, self.s.batch_rows)
        caller = Caller(
            self.fn,
            self.id,
            max_attempts=self.s.max_attempts,
            retry_delay_seconds=self.s.retry_delay_seconds,
            outage_after=outage_at,
            throttle=self.throttle,
            spend=self.spend,
            halt=self.sink.halted,
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
        if caller.broken is not None:
            return FunctionError(self.label, caller.broken, self.done_rows)
        if caller.outage:
            last = caller.last_error or "every call failed"
            return OutageError(self.label, outage_at, last, self.done_rows)
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
        """The outcomes of the batches, as many at a time as are ready."""
        batches = caller.batches(todo, self.s.batch_rows)
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
        """How long to wait for a call before looking at the sink again: briefly while rows
        wait for the writer to be free, else until a time-based flush could be due."""
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
        """Hand the rows done to the sink when a flush of them is due, and the first result at
        once: its output columns must be storable before more calls are paid for."""
        if self.sink.due(self.pending_rows):
            self._commit()
            self.sink.flush()
        elif self.pending and self.sink.outputs is None:
            self._commit()
