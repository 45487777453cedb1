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

import asyncio
import contextlib
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import polars as pl

from checkpoint_assets.engine import hashing
from checkpoint_assets.engine.calls import BatchFn, Caller, Outcome, outage_threshold
from checkpoint_assets.engine.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import (
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
    fn: BatchFn,
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
) -> tuple[pl.DataFrame, RunStats]:
    """Run ``fn`` over ``inputs`` (already ``prepare()``d) with resume and checkpointing.

    Returns the result (id, outputs, ``_error``; one row per input id) and the run's stats.
    With ``checkpointing`` off, ``checkpoint`` is ignored and nothing is read or written.
    ``job``: the settings that change results (their fingerprint identifies the job).
    ``imported``: finished rows from other checkpoints of the same job (global resume); those
    whose id and input hash match a row of ``inputs`` are copied into this checkpoint and skipped.
    ``function_fingerprint``: the fingerprint of ``fn`` (``function_fingerprint.of_function``,
    merged with ``of_resources``). When the checkpoint recorded another one under the same job,
    the run warns (once its stored results are reused) and reports it in ``stats``; when it
    finishes, the checkpoint records this one. None: nothing is compared or recorded.
    """
    log = logger or logging.getLogger("checkpoint_assets")
    stats = RunStats(rows_total=inputs.height)
    stats.input_fingerprint = hashing.fingerprint(inputs.get_column(INPUT_HASH).to_numpy())
    label = label or "checkpoint"

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
        return Run(fn, inputs, settings, opened, sink, stats, log, label).execute()
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
        return Run(fn, inputs, settings, opened, sink, stats, log, label).execute()
    finally:
        lease.release()
        stats.requests = dict(checkpoint.store.requests)


class Run:
    """The loop of one run: dispatch batches, absorb their outcomes, report progress."""

    def __init__(
        self,
        fn: BatchFn,
        inputs: pl.DataFrame,
        settings: Settings,
        opened: Opened,
        sink: Sink,
        stats: RunStats,
        log: Logger,
        label: str,
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
        self.started = time.monotonic()
        self.last_progress = self.started

    def execute(self) -> tuple[pl.DataFrame, RunStats]:
        try:
            with _sigterm_as_interrupt():
                try:
                    stopped = self.work(self.opened.todo)
                except BaseException:
                    self.sink.flush_before_leaving(self.log)
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
        )
        try:
            for outcome in self._outcomes(caller, todo):
                if caller.outage:
                    # Failures seen during an outage say nothing about the rows; results of
                    # calls that succeeded before it (batches still in flight) are kept.
                    self.suspect.clear()
                    outcome.failed.clear()
                self._absorb(outcome)
                self.sink.maybe_flush()
                self._maybe_progress()
        finally:
            caller.close()
        if caller.broken is not None:
            self._commit(self.suspect)
            return FunctionError(self.label, caller.broken, self.done_rows)
        if caller.outage:
            self.suspect.clear()
            last = caller.last_error or "every call failed"
            return OutageError(self.label, self.outage_at, last, self.done_rows)
        self._commit(self.suspect)
        self.suspect = []
        spent = self.throttle.quota_spent
        if spent is not None:
            return QuotaExhaustedError(self.label, spent, self.done_rows)
        return None

    def _outcomes(self, caller: Caller, todo: pl.DataFrame) -> Iterator[Outcome]:
        size = self.s.batch_rows
        batches = (todo.slice(i, size) for i in range(0, todo.height, size))
        if self.s.max_concurrency <= 1:
            for batch in batches:
                yield caller.process(batch)
                if caller.stopping:
                    return
            return
        yield from self._concurrently(caller, batches)

    def _concurrently(self, caller: Caller, batches: Iterator[pl.DataFrame]) -> Iterator[Outcome]:
        """``max_concurrency`` workers take batches and call the function; their outcomes come
        back here, to the one thread that hands results to the sink.

        Workers are threads, or tasks on the event loop of an ``async def`` function. A worker
        goes on to its next batch as soon as a call returns, without a round trip through this
        thread. A batch holds a slot from when a worker takes it until its outcome is absorbed
        here, so calls in flight and results waiting for this thread are ``batches_held``
        batches at most: while this thread waits for storage, workers stop taking batches. The
        shard's throttle decides how many of them may call the function at a time (fewer while
        the endpoint rate limits).
        """
        results: queue.SimpleQueue[Outcome | BaseException | None] = queue.SimpleQueue()
        workers = self.s.max_concurrency
        start = _tasks if caller.loop is not None else _threads
        release, leave = start(caller, batches, workers, self.s.batches_held, results)
        running = workers
        try:
            while running:
                try:
                    item = results.get(timeout=self._poll_seconds())
                except queue.Empty:
                    self.sink.maybe_flush()  # a flush may be due by time, or the writer free
                    continue
                release()  # the batch's slot (or, at a worker's end, one for the next to end)
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            leave()  # on an exception or a stop: finish the calls in flight, take no more

    def _poll_seconds(self) -> float:
        """How long to wait for a call before looking at the sink again: briefly while rows
        wait for the writer to be free, else until a time-based flush could be due."""
        return 0.05 if self.sink.buffered_rows else self.s.flush_seconds

    def _absorb(self, outcome: Outcome) -> None:
        self.stats.calls += outcome.calls
        self.stats.failed_calls += outcome.failed_calls
        self.stats.throttled_calls += outcome.throttled_calls
        if outcome.ok:
            if self.sink.outputs is None:
                self._check_usage(outcome.ok[0])
            self.sink.learn_outputs(outcome.ok[0])
            self._commit(self.suspect + outcome.ok + outcome.failed)
            self.suspect = []
        else:
            self.suspect.extend(outcome.failed)
        if outcome.failed:
            self.last_error = str(outcome.failed[-1].get_column(ERROR)[-1])

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

    def _commit(self, frames: Sequence[pl.DataFrame]) -> None:
        frames = [f for f in frames if f.height]
        if not frames:
            return
        computed = frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed")
        done = computed
        if self.opened.copies is not None and self.opened.copies.rows.height:
            copies = self.opened.copies.of(computed, self.id)
            done = pl.concat([computed, copies], how="diagonal_relaxed")
        self.stats.rows_computed += computed.height
        for c in self.usage:
            if c in computed.columns:
                self.usage[c] += float(computed.get_column(c).sum() or 0)
        self.stats.rows_reused += done.height - computed.height
        self.done_rows += done.height
        self.failed_rows += done.height - done.get_column(ERROR).null_count()
        self.sink.add(done)

    def _maybe_progress(self) -> None:
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


Results = queue.SimpleQueue[Outcome | BaseException | None]


def _threads(
    caller: Caller, batches: Iterator[pl.DataFrame], workers: int, held: int, results: Results
) -> tuple[Callable[[], None], Callable[[], None]]:
    """Start ``workers`` threads taking batches while fewer than ``held`` are out; returns how
    to release a slot and how to make them leave."""
    slots = threading.Semaphore(held)
    take = threading.Lock()
    leaving = threading.Event()

    def work() -> None:
        try:
            while True:
                slots.acquire()
                if leaving.is_set() or caller.stopping:
                    return
                with take:
                    batch = next(batches, None)
                if batch is None:
                    return
                results.put(caller.process(batch))
        except BaseException as e:  # handed to the loop, which raises it
            results.put(e)
        finally:
            results.put(None)  # this worker is done

    for i in range(workers):
        threading.Thread(target=work, name=f"checkpoint-{i}", daemon=True).start()

    def leave() -> None:
        leaving.set()
        slots.release(workers)

    return slots.release, leave


def _tasks(
    caller: Caller, batches: Iterator[pl.DataFrame], workers: int, held: int, results: Results
) -> tuple[Callable[[], None], Callable[[], None]]:
    """Start ``workers`` tasks on the function's event loop (one thread for every call)."""
    loop = caller.loop
    assert loop is not None
    slots = asyncio.Semaphore(held)
    leaving = threading.Event()

    async def work() -> None:
        try:
            while True:
                await slots.acquire()
                if leaving.is_set() or caller.stopping:
                    return
                batch = next(batches, None)  # only this loop's thread takes batches
                if batch is None:
                    return
                results.put(await caller.aprocess(batch))
        except BaseException as e:  # handed to the loop, which raises it
            results.put(e)
        finally:
            results.put(None)

    tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks

    async def start() -> None:
        for _ in range(workers):
            task = loop.create_task(work())
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    asyncio.run_coroutine_threadsafe(start(), loop).result()

    def release() -> None:
        loop.call_soon_threadsafe(slots.release)

    def leave() -> None:
        leaving.set()
        for _ in range(workers):
            loop.call_soon_threadsafe(slots.release)

    return release, leave


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
