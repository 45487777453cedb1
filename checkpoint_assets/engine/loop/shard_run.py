"""What every work loop of one shard's run shares: its state, how it ends and what it hands over.

A work loop subclasses :class:`ShardRun` and writes ``work``. There are two:
``runner.Run`` calls the user's function, and ``provider_batches.ProviderRun`` goes through a
provider's batch API. Work that brings its own loop reaches ``runner.run()`` as an
:class:`OwnLoop`, which starts it. The rest is here. ``execute()`` runs these steps in order:

1. ``work(todo)``, inside SIGTERM-as-Ctrl-C. This is the loop. Its rows done go to ``pending``
   and ``pending_failed``. Then ``_commit()`` builds them into one frame and checks their output
   columns (and ``usage_columns``). It hands them to the sink (``_hand_over``: counted once).
   ``_maybe_progress()`` logs a ``progress_line()`` every ``progress_seconds``.
2. On any exception, SIGTERM or SIGINT, ``_keep_what_is_done()`` hands the rows done to the sink
   and flushes them.
3. When ``work()`` returns, ``close()`` finalizes through the sink and counts the result. It
   applies the stop rules: why ``work()`` stopped early, and too many failed rows.
4. In any case (``finally``), it closes the sink. It then records the stats: the sink's, the
   throttle's (pacing too), usage and cost.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls.batches import Record, build
from checkpoint_assets.engine.calls.budget import Spend
from checkpoint_assets.engine.calls.throttle import Throttle
from checkpoint_assets.engine.errors import CheckpointError, TooManyFailuresError
from checkpoint_assets.engine.loop.lock import RunWatch
from checkpoint_assets.engine.loop.sink import Logger, Sink
from checkpoint_assets.engine.plan.inputs import Prepared
from checkpoint_assets.engine.plan.opening import Opened
from checkpoint_assets.engine.plan.reparse import Parse
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.rows import ERROR, NO_RESULT, outputs_of
from checkpoint_assets.engine.settings import RunStats, Settings
from checkpoint_assets.engine.sharding.scheme import Scheme


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """Where and how one shard runs, beside its function, rows, checkpoint and settings.

    ``scheme``: its shard rule, recorded in the meta. ``run_id``, ``watch``: the run holding
    the lock, and what its heartbeat asks about runs (``lock.py``). ``logger``, ``label``: where
    its lines go and how they name the shard. ``imported``: finished rows of other checkpoints
    of the same job (global resume). ``function_fingerprint``: the function's fingerprint
    (``function_fingerprint.py``), compared with the one recorded; None: nothing compared.
    ``spend``: the tally its calls add to (a ranged run's shards share one); None: a new one
    when the settings have a budget.
    ``results``: the result store the shard takes results from and adds its own to (``reuse/``);
    its rows must be prepared with their content key (``prepare(..., content=True)``).
    ``parse``: a request/parse job that keeps its answers has it (``opening.Job.parse``).
    """

    scheme: Scheme | None = None
    run_id: str | None = None
    watch: RunWatch | None = None
    logger: Logger | None = None
    label: str = ""
    imported: pl.DataFrame | None = None
    function_fingerprint: Mapping[str, str] | None = None
    spend: Spend | None = None
    results: ResultStore | None = None
    parse: Parse | None = None

    @property
    def log(self) -> Logger:
        return self.logger or logging.getLogger("checkpoint_assets")

    @property
    def name(self) -> str:
        """How lines name the shard."""
        return self.label or "checkpoint"


@dataclass(frozen=True)
class OwnLoop:
    """Work that brings its own work loop, such as a provider job (``provider_batches.py``).

    ``start`` makes the shard's loop from what ``runner.run()`` prepared and opened: the
    prepared rows, the settings, the opening, the sink, the stats and the context, in the order
    of :class:`ShardRun`'s arguments. ``runner.run()`` then executes it.
    """

    start: Callable[[Prepared, Settings, Opened, Sink, RunStats, RunContext], ShardRun]


class ShardRun(abc.ABC):
    """One run of one shard, whatever its work loop.

    It owns the counts, the hand-over of rows done to the sink, progress lines and the end
    (finalize, the result, stop rules, cost)."""

    def __init__(
        self,
        prepared: Prepared,
        settings: Settings,
        opened: Opened,
        sink: Sink,
        stats: RunStats,
        context: RunContext,
    ) -> None:
        self.prepared = prepared
        self.inputs = prepared.keys  # id, input hash, position: the input rows stay where they are
        self.s = settings
        self.opened = opened
        self.sink = sink
        self.stats = stats
        self.log = context.log
        self.label = context.name
        spend = context.spend
        self.id = settings.id_column
        stats.rows_resumed = opened.plan.resumed
        stats.rows_dropped = opened.plan.dropped
        stats.rows_changed = opened.plan.changed
        stats.rows_imported = opened.imported
        stats.rows_from_store = opened.from_store
        stats.cost_saved_usd = opened.cost_saved
        stats.function_changed = list(opened.function_changed)
        self.todo_rows = opened.plan.todo.height
        self.done_rows = 0
        self.failed_rows = 0  # rows this run stored as failed (for progress lines)
        # Rows done and not yet handed to the sink: built into one frame when a flush is due.
        self.pending: list[Record] = []
        self.pending_failed: list[pl.DataFrame] = []
        self.pending_rows = 0
        self.last_error = ""
        self.throttle = Throttle(settings)
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
            self.stats.budget_used = self.throttle.pacing.budget_used
            self.stats.budget_wait_seconds = round(self.throttle.pacing.wait_seconds, 3)
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

    @abc.abstractmethod
    def work(self, todo: pl.DataFrame) -> CheckpointError | None:
        """Process ``todo``; returns why the shard stopped early, or None."""

    # -- handing the rows done to the sink -----------------------------------------------
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
        done = self.stats.rows_resumed + self.stats.rows_from_store + self.done_rows
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
