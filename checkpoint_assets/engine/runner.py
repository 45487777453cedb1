"""The run loop: one checkpointed run, free of Dagster.

``run()`` is the whole life of one run::

    prepare()    validate ids and input columns, hash every input row
    open_run()   take the lock, check the job, load what is stored, plan the rest (opening.py)
    Run.work     call the function on batches of ``batch_size`` rows (threads, or asyncio for an
                 ``async def``, up to ``max_concurrency`` in flight; rate limits in throttle.py;
                 retries, poison rows, broken functions and outages in calls.py) and hand
                 results to the sink, which flushes every ``checkpoint_interval`` rows without
                 holding up the calls (sink.py); on any exception, SIGTERM or SIGINT, flush what
                 is done before leaving
    Run.close    finalize through the sink, count the result, apply the stop rules (an outage,
                 a broken function, a spent quota, too many failed rows)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import polars as pl

from checkpoint_assets.engine import hashing, workers
from checkpoint_assets.engine.batches import Batch, PerRow, Record, build, height
from checkpoint_assets.engine.budget import Spend
from checkpoint_assets.engine.calls import BatchFn, Caller, Outcome, outage_threshold
from checkpoint_assets.engine.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import (
    BudgetExceededError,
    CheckpointError,
    FunctionError,
    MissingColumnsError,
    OutageError,
    QuotaExhaustedError,
    TooManyFailuresError,
)
from checkpoint_assets.engine.lock import Lease
from checkpoint_assets.engine.opening import Job, Opened, open_run
from checkpoint_assets.engine.resume import canonical_ids, validate_ids
from checkpoint_assets.engine.rows import ERROR, INPUT_HASH, NO_RESULT, outputs_of
from checkpoint_assets.engine.scheme import Scheme
from checkpoint_assets.engine.settings import RunStats, Settings
from checkpoint_assets.engine.sink import Logger, MemorySink, PartWriter, Sink
from checkpoint_assets.engine.throttle import Throttle


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
    fn: BatchFn | PerRow,
    inputs: pl.DataFrame,
    checkpoint: Checkpoint | None,
    settings: Settings,
    *,
    job: Mapping[str, Any],
    scheme: Scheme | None = None,
    run_id: str | None = None,
    is_run_finished: Callable[[str], bool] | None = None,
    logger: Logger | None = None,
    label: str = "",
    imported: pl.DataFrame | None = None,
    function_fingerprint: Mapping[str, str] | None = None,
    spend: Spend | None = None,
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
    run; default: a new one); no call starts once it reaches a limit (see engine/budget.py).
    """
    log = logger or logging.getLogger("checkpoint_assets")
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
        return Run(fn, inputs, settings, opened, sink, stats, log, label, spend).execute()
    if checkpoint is None:
        raise ValueError("A run with checkpointing needs a checkpoint (or checkpointing=False).")
    stats.checkpoint_path = checkpoint.url
    lease = Lease(
        checkpoint.store,
        checkpoint.files.lock,
        run_id=run_id,
        lease_seconds=settings.lease_seconds,
        is_run_finished=is_run_finished,
        logger=log,
    )
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
        return Run(fn, inputs, settings, opened, sink, stats, log, label, spend).execute()
    finally:
        lease.release()
        stats.requests = dict(checkpoint.store.requests)


def _one_row_per_call(settings: Settings, label: str) -> Settings:
    if settings.batch_size not in (None, 1):
        raise CheckpointError(
            f"{label or 'checkpoint'}: batch_size={settings.batch_size}, but the function takes "
            "one row (a dict) per call.",
            "Leave batch_size unset for a per-row function, or take a frame of rows "
            "(annotate the first parameter as pl.DataFrame).",
        )
    return dataclasses.replace(settings, batch_size=1)


class Run:
    """The loop of one run: dispatch batches, absorb their outcomes, report progress."""

    def __init__(
        self,
        fn: BatchFn | PerRow,
        inputs: pl.DataFrame,
        settings: Settings,
        opened: Opened,
        sink: Sink,
        stats: RunStats,
        log: Logger,
        label: str,
        spend: Spend | None = None,
    ) -> None:
        self.fn = fn
        self.inputs = inputs
        self.s = settings
        self.opened = opened
        self.sink = sink
        self.stats = stats
        self.log = log
        self.label = label
        self.id = settings.id_column
        stats.rows_resumed = opened.plan.resumed
        stats.rows_dropped = opened.plan.dropped
        stats.rows_changed = opened.plan.changed
        stats.rows_imported = opened.imported
        stats.function_changed = list(opened.function_changed)
        self.todo_rows = opened.plan.todo.height
        self.done_rows = 0
        self.failed_rows = 0  # rows this run stored as failed (for progress lines)
        # Rows done and not yet handed to the sink: built into one frame when a flush is due.
        self.pending: list[Record] = []
        self.pending_failed: list[pl.DataFrame] = []
        self.pending_rows = 0
        self.suspect: list[pl.DataFrame] = []  # failures that an outage may still disown
        self.last_error = ""
        self.outage_at = outage_threshold(settings.max_attempts, settings.batch_rows)
        self.throttle = Throttle(
            settings.max_concurrency,
            max_seconds=settings.max_throttle_seconds,
            base_delay=settings.retry_delay_seconds,
            min_concurrency=settings.min_concurrency,
            adaptive=settings.adaptive_concurrency,
        )
        self.usage = dict.fromkeys(settings.usage_columns, 0.0)
        self.spend = spend
        self.spent_before = (spend.spent, dict(spend.by_model)) if spend else (0.0, {})
        self.started = time.monotonic()
        self.last_progress = self.started

    def execute(self) -> tuple[pl.DataFrame, RunStats]:
        try:
            with _sigterm_as_interrupt():
                try:
                    stopped = self.work(self.opened.todo)
                except BaseException:
                    self._keep_what_is_done()
                    raise
            return self.close(stopped)
        finally:
            self.sink.close()
            self.stats.flushes = self.sink.flushes
            self.stats.wait_seconds = self.sink.wait_seconds
            self.stats.finalize_seconds = self.sink.finalize_seconds
            self.stats.throttle_events = self.throttle.events
            self.stats.throttled_seconds = round(self.throttle.throttled_seconds, 3)
            self.stats.concurrency_final = self.throttle.limit
            self.stats.usage = self.usage
            self._count_cost()

    def _count_cost(self) -> None:
        """This shard's part of the spend (a ranged run's shards share one tally)."""
        if self.spend is None:
            return
        spent, by_model = self.spent_before
        self.stats.cost_usd = self.spend.spent - spent
        self.stats.cost_by_model = {
            m: usd - by_model.get(m, 0.0)
            for m, usd in self.spend.by_model.items()
            if usd != by_model.get(m, 0.0)
        }

    # -- the work loop -------------------------------------------------------------------
    def work(self, todo: pl.DataFrame) -> CheckpointError | None:
        """Process ``todo``; returns why the shard stopped early, or None."""
        caller = Caller(
            self.fn,
            self.id,
            max_attempts=self.s.max_attempts,
            retry_delay_seconds=self.s.retry_delay_seconds,
            outage_after=self.outage_at,
            throttle=self.throttle,
            spend=self.spend,
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
        if caller.broken is not None:
            return FunctionError(self.label, caller.broken, self.done_rows)
        if caller.outage:
            last = caller.last_error or "every call failed"
            return OutageError(self.label, self.outage_at, last, self.done_rows)
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

    def _keep_what_is_done(self) -> None:
        """On an exception: store the rows done, without hiding the exception."""
        try:
            self._commit()
        except Exception as e:  # the original exception matters more
            self.log.error("Could not keep the last results before stopping: %s", e)
        self.sink.flush_before_leaving(self.log)

    def _commit(self) -> None:
        """Build the rows done into one frame (see batches.py), check their output columns and
        types, count them and hand them to the sink. A result whose types changed raises, after
        the rows before it are handed over."""
        frames = build(self.pending, self.id, self.inputs.schema[self.id])
        checked: list[pl.DataFrame] = []
        for frame in frames:
            try:
                if self.sink.outputs is None:
                    self._check_usage(frame)
                self.sink.learn_outputs(frame)
            except CheckpointError:
                self._hand_over(checked + self.pending_failed)  # the rest is refused
                raise
            checked.append(frame)
        self._hand_over(checked + self.pending_failed)

    def _check_usage(self, sample: pl.DataFrame) -> None:
        bad = [
            c
            for c in self.s.usage_columns
            if c not in sample.columns or not sample.schema[c].is_numeric()
        ]
        if bad:
            numeric = [c for c in outputs_of(sample, self.id) if sample.schema[c].is_numeric()]
            raise CheckpointError(
                f"{self.label}: usage_columns {bad} are not numeric output columns of the "
                f"function (its numeric outputs: {numeric}).",
                "Return them from the function, or remove them from usage_columns.",
            )

    def _hand_over(self, frames: Sequence[pl.DataFrame]) -> None:
        frames = [f for f in frames if f.height]
        if not frames:
            self.pending, self.pending_failed, self.pending_rows = [], [], 0
            return
        computed = frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed")
        done = computed
        if self.opened.copies is not None and self.opened.copies.rows.height:
            copies = self.opened.copies.of(computed, self.id)
            done = pl.concat([computed, copies], how="diagonal_relaxed")
        rows_computed = self.stats.rows_computed + computed.height
        usage = dict(self.usage)
        for c in usage:
            if c in computed.columns:
                usage[c] += float(computed.get_column(c).sum() or 0)
        failed = done.height - done.get_column(ERROR).null_count()
        # Nothing below can fail: the rows are counted once, and handed over once.
        self.pending, self.pending_failed, self.pending_rows = [], [], 0
        self.stats.rows_computed, self.usage = rows_computed, usage
        self.stats.rows_reused += done.height - computed.height
        self.done_rows += done.height
        self.failed_rows += failed
        self.sink.add(done)

    def _maybe_progress(self) -> None:
        if self.spend is not None:
            self.spend.maybe_refresh()  # what other shards spent meanwhile
        now = time.monotonic()
        if now - self.last_progress >= self.s.progress_seconds:
            self.last_progress = now
            self.log.info("%s", self.progress_line(now))

    def progress_line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.done_rows / elapsed
        left = max(self.todo_rows - self.done_rows, 0)
        eta = f"{left / rate:,.0f} s" if rate > 0 else "unknown"
        done = self.stats.rows_resumed + self.done_rows
        total = max(self.stats.rows_total, 1)
        return (
            f"{self.label}: {done:,} / {self.stats.rows_total:,} rows "
            f"({100 * done / total:.1f}%), {rate:,.1f} rows/s, ETA {eta}, "
            f"{self.failed_rows:,} failed, {self.stats.rows_reused:,} reused"
        )

    # -- the end -------------------------------------------------------------------------
    def close(self, stopped: CheckpointError | None) -> tuple[pl.DataFrame, RunStats]:
        stored = self.sink.finish(self.inputs.get_column(self.id))
        self.stats.seconds = time.monotonic() - self.started
        result = self._result(stored)
        failed = int(result.get_column(ERROR).is_not_null().sum())
        self.stats.rows_failed = failed
        counts = {"total": self.stats.rows_total, "ok": result.height - failed, "failed": failed}
        self.stats.usage_total = {
            c: float(result.get_column(c).sum() or 0) if c in result.columns else 0.0
            for c in self.s.usage_columns
        }
        self.sink.record_finish(self.stats.input_fingerprint, counts, self.stats.usage_total)
        self.log.info("%s", self.progress_line(time.monotonic()))
        if stopped is not None:
            raise stopped
        if failed and failed / max(self.stats.rows_total, 1) > self.s.max_failed_fraction:
            no_result = result.filter(pl.col(ERROR) == NO_RESULT).get_column(self.id)
            raise TooManyFailuresError(
                self.label,
                failed,
                self.stats.rows_total,
                self.s.max_failed_fraction,
                self.last_error,
                no_result=no_result.len(),
                no_result_ids=no_result.head(5).to_list(),
            )
        return result, self.stats

    def _result(self, stored: pl.DataFrame) -> pl.DataFrame:
        """id, outputs and ``_error`` of every stored row of the result."""
        outputs = self.sink.outputs or outputs_of(stored, self.id)
        if stored.height == 0 or self.id not in stored.columns:
            schema: dict[str, Any] = {self.id: self.inputs.schema[self.id]}
            schema |= {c: pl.Null for c in outputs}
            schema[ERROR] = pl.String
            return pl.DataFrame(schema=schema)
        for c in [*outputs, ERROR]:
            if c not in stored.columns:
                stored = stored.with_columns(pl.lit(None).alias(c))
        return stored.select(self.id, *outputs, ERROR)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Outside Dagster, make SIGTERM interrupt like Ctrl-C so buffered rows get flushed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield  # somebody (Dagster) already handles it, by raising into this thread
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
