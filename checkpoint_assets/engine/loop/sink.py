"""Where a run's results go: ``PartWriter`` (parts on storage) or ``MemorySink`` (no checkpoint).

Both take the run's ``Settings`` and computed rows with ``add``. They flush every
``checkpoint_interval`` rows or ``flush_seconds``, never more often than ``min_flush_seconds``.
``finish`` returns every stored row of the run's result. The run loop does not know which one it
has. It keeps the rows done as the calls returned them, until ``due`` says a flush of them should
start. Then it builds them into one frame and hands it over with ``add`` (see batches.py). These
rows belong to the buffer below as much as the rows handed over.

``PartWriter`` hands each flush to a background thread. That thread writes the part and compacts
while the function works on. At most one flush is in flight, and dispatching never waits for it
(group commit). Rows that complete while a part is being written stay in the buffer. They go
together into the next flush, as soon as the writer is free.

The run waits for storage only when the buffer outgrows ``Settings.max_unflushed_rows``: two
intervals plus the rows of the calls in flight. It encodes its own part during the wait. This bounds
memory and loss when storage is slower than the function. ``finish`` waits for the last write, then
merges everything into the merged file. A run never succeeds before its rows are durable.

Loss bound. A hard kill (SIGKILL, a lost node) loses the rows that are not durable yet.
``Settings.loss_bound()`` computes the most, term by term:

- the buffer: the rows done since the last flush. That is about one ``checkpoint_interval``
  while storage keeps up, and up to ``max_unflushed_rows`` when it lags (group commit). It is
  the rows done in ``min_flush_seconds`` when those are more. The last batch added may cross
  that by all its rows but one;
- the flush being written (one at most, no larger than the buffer was);
- the calls in flight and the results the run loop has not taken yet: ``batches_held`` batches
  of ``batch_size`` rows (``max_concurrency`` and a quarter more).

Take one-row calls, ``checkpoint_interval=64`` and 32 calls in flight on local disk. That is
160 + 160 + 40 = 360 rows at most, and about 64 + 64 + 40 while storage keeps up. On S3
(``min_flush_seconds`` 5) with a function doing 100 rows per second, the buffer holds about 500
rows, 5 s of work: 500 + 500 + 40 at most. SIGTERM, SIGINT and exceptions flush before leaving
and lose nothing. A writer that lost its lock (see lock.py) writes nothing more. So it loses
what a hard kill would; the new holder computes those rows again.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import time

import polars as pl

from checkpoint_assets.engine import rows
from checkpoint_assets.engine.checkpoints import parquet
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import (
    CheckpointError,
    JobMismatchError,
    LockHeldError,
    RunStoppedError,
)
from checkpoint_assets.engine.loop.lock import Lease
from checkpoint_assets.engine.plan.start import Start
from checkpoint_assets.engine.reuse.contribution import Contribution
from checkpoint_assets.engine.rows import CURRENT, SEQ
from checkpoint_assets.engine.settings import Settings

_NULL = str(pl.Null)
Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]


class Sink:
    """The buffer of computed rows and when to flush it; subclasses say where flushes go."""

    def __init__(
        self,
        settings: Settings,
        *,
        min_flush_seconds: float,
        outputs: list[str] | None,
        where: str,
        types: dict[str, str] | None = None,
    ) -> None:
        self.id_column = settings.id_column
        self.interval = settings.checkpoint_interval
        self.max_unflushed = settings.max_unflushed_rows
        self.flush_seconds = settings.flush_seconds
        self.min_flush_seconds = min_flush_seconds  # the settings', else the store's
        self.outputs = outputs  # the output columns, once known
        # The output types seen so far (a column that was all null takes its first real type),
        # and the schema of the last result checked.
        self.types: dict[str, str] = dict(types or {})
        self._checked: pl.Schema | None = None
        self.where = where  # the checkpoint, for messages
        self.buffer: list[pl.DataFrame] = []
        self.buffered_rows = 0
        self.last_flush = time.monotonic()
        self.flushes = 0
        self.wait_seconds = 0.0
        self.finalize_seconds = 0.0

    # -- what every sink does ------------------------------------------------------------
    def learn_outputs(self, sample: pl.DataFrame) -> None:
        """Record the output columns and types on the first result; refuse a change later.

        A type that changes between results would be coerced when rows are merged (1 becoming
        "1", or 1.0). That would rewrite results already stored. So it is refused, except for a
        column that was null in every row so far.
        """
        schema = sample.schema
        if schema == self._checked:
            return  # the schema of the previous result, already checked (the usual case)
        outputs = {c: str(schema[c]) for c in rows.outputs_of(sample, self.id_column)}
        if self.outputs is None:
            self.outputs = list(outputs)
            self.types = dict(outputs)
            self.record_outputs(sample, outputs)
        elif sorted(outputs) != sorted(self.outputs):  # metas of older releases list them sorted
            raise JobMismatchError(
                self.where,
                f"The function now returns the columns {list(outputs)}, but the checkpoint "
                f"{self.where} holds results with {self.outputs}. A changed output schema is a "
                "different job.",
            )
        else:
            self._check_types(outputs)
        self._checked = schema

    def _check_types(self, outputs: dict[str, str]) -> None:
        for column, new in outputs.items():
            old = self.types.get(column)
            if old is None or old == _NULL:
                self.types[column] = new
            elif new not in (old, _NULL):
                error = JobMismatchError(
                    self.where,
                    f"The function returned the column {column!r} as {new}, but earlier results "
                    f"(of this run or stored in {self.where}) have it as {old}; merging them "
                    "would change the stored values.",
                )
                error.remedy = (
                    "Return one type for every batch (cast the column in the function); if the "
                    "type changed on purpose, it is a different job: use a new checkpoint tag or "
                    "run with resume=False."
                )
                raise error

    def add(self, computed: pl.DataFrame) -> None:
        self.buffer.append(computed)
        self.buffered_rows += computed.height

    def due(self, pending: int = 0) -> bool:
        """Whether to flush the buffer and ``pending`` more rows done now.

        A flush must be due. The previous one must be written, or the rows outgrew
        ``max_unflushed_rows``. Else they join the next flush (group commit)."""
        rows = self.buffered_rows + pending
        if not rows:
            return False
        since = time.monotonic() - self.last_flush
        due = rows >= self.interval or since >= self.flush_seconds
        if not due or since < self.min_flush_seconds:
            return False
        return not (self.busy() and rows < self.max_unflushed)

    def busy(self) -> bool:
        """Whether a flush is still being written."""
        return False

    def buffered(self) -> pl.DataFrame:
        """The buffered rows as one frame (the buffer keeps them)."""
        if len(self.buffer) == 1:
            return self.buffer[0]
        # One chunk: a frame of 64 one-row chunks costs twice the CPU to encode as a part.
        return pl.concat(self.buffer, how="diagonal_relaxed", rechunk=True)

    def claim(self) -> None:
        """The buffered rows now belong to a flush: empty the buffer."""
        self.buffer, self.buffered_rows = [], 0
        self.last_flush = time.monotonic()

    # -- what each sink does its own way -------------------------------------------------
    def record_outputs(self, sample: pl.DataFrame, outputs: dict[str, str]) -> None:
        """The output columns became known (``sample``: the first result)."""

    def flush(self) -> None:
        raise NotImplementedError

    def halted(self) -> str | None:
        """Why no call may start any more (the lock lost, the run over), or None."""
        return None

    def halt_error(self, label: str, done: int) -> CheckpointError | None:
        """The error a run that ``halted`` ends with (``done``: the rows it computed)."""
        return None

    def flush_before_leaving(self, log: Logger) -> None:
        """On an exception: keep what is done, without hiding the exception."""

    def finish(self, current_ids: pl.Series) -> pl.DataFrame:
        """Every stored row of the result (bookkeeping columns included)."""
        raise NotImplementedError

    def record_finish(
        self, input_fingerprint: str, counts: dict[str, int], usage: dict[str, float]
    ) -> None:
        """What the finished run holds, for status reports."""

    def close(self) -> None:
        """Release what the sink holds (threads), whatever happened."""


class MemorySink(Sink):
    """Keeps results in memory: ``checkpointing: false`` reads and writes nothing.

    A flush here costs no request: it keeps no minimum time between flushes."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, min_flush_seconds=0.0, outputs=None, where="(in memory)")
        self.kept: list[pl.DataFrame] = []

    def flush(self) -> None:
        if self.buffer:
            self.kept.append(self.buffered())
            self.claim()

    def finish(self, current_ids: pl.Series) -> pl.DataFrame:
        self.flush()
        return pl.concat(self.kept, how="diagonal_relaxed") if self.kept else pl.DataFrame()


class PartWriter(Sink):
    """Writes flushes as parts of one checkpoint (see the module docstring)."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        start: Start,
        lease: Lease | None,
        settings: Settings,
        *,
        contribution: Contribution | None = None,
    ) -> None:
        meta = start.meta
        floor = settings.min_flush_seconds
        super().__init__(
            settings,
            min_flush_seconds=checkpoint.store.min_flush_seconds if floor is None else floor,
            outputs=list(meta.output_schema) if meta and meta.output_schema else None,
            types=meta.output_schema if meta else None,
            where=checkpoint.url,
        )
        self.checkpoint = checkpoint
        if lease is not None:
            checkpoint.fence = lease.check  # a writer that lost its lock writes nothing more
        self.meta = meta
        self.function_fingerprint = start.function_fingerprint
        self.lease = lease
        self.base_seq = start.base_seq
        self.next_seq = start.next_seq
        self.parts = start.parts
        self.known = start.known  # valid while this run has written nothing
        self._pool: cf.ThreadPoolExecutor | None = None
        self._writing: cf.Future[None] | None = None
        self._unwritten: pl.DataFrame | None = None  # the rows of a part whose write failed
        # The result store's share of the rows, handed over once durable (``reuse/``).
        self.contribution = contribution

    def record_outputs(self, sample: pl.DataFrame, outputs: dict[str, str]) -> None:
        parquet.check_storable(sample.head(1))
        if self.meta is not None:
            self.meta.output_schema = outputs
            self.checkpoint.fenced()
            self.checkpoint.meta_file.write(self.meta)

    def halted(self) -> str | None:
        return self.lease.halted() if self.lease is not None else None

    def halt_error(self, label: str, done: int) -> CheckpointError | None:
        lease = self.lease
        if lease is None or lease.halted() is None:
            return None
        if lease.lost is not None:
            return LockHeldError(lease.lost)
        return RunStoppedError(label, lease.stopped or "", done)

    def busy(self) -> bool:
        return self._writing is not None and not self._writing.done()

    def flush(self) -> None:
        """Hand the buffered rows to the background writer as one part (waiting for the one
        being written first)."""
        if not self.buffer:
            return
        seq = self.next_seq
        frame = rows.stamped(self.buffered(), seq)
        data = None
        if self._writing is not None and not self._writing.done():
            data = self.checkpoint.encode_part(frame, self.id_column)  # use the wait
        self.wait_for_writes()  # its error leaves the buffer as it is
        self.checkpoint.fenced()  # a writer that lost its lock writes nothing more
        self._claim_seq()
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._writing = self._pool.submit(self._write, frame, seq, data)

    def _claim_seq(self) -> None:
        """The buffered rows now belong to the flush numbered ``next_seq``."""
        self.claim()
        self.next_seq += 1
        self.flushes += 1
        self.known = None

    def _write(self, frame: pl.DataFrame, seq: int, data: bytes | None) -> None:
        """The writer thread's job: one part (``data``, if encoded already), then compaction."""
        try:
            part = self.checkpoint.write_part(frame, seq, data=data, id_column=self.id_column)
        except BaseException:
            self._unwritten = frame  # written again before leaving: those calls are paid for
            raise
        if self.contribution is not None:
            self.contribution.durable(frame)
        self.parts = self.checkpoint.compact([*self.parts, part], self.id_column)

    def wait_for_writes(self) -> None:
        """Block until the flush in flight is durable; raise its error if it failed."""
        writing, self._writing = self._writing, None
        if writing is not None:
            started = time.perf_counter()
            try:
                writing.result()
            finally:
                self.wait_seconds += time.perf_counter() - started

    def begin_generation(self, seq: int) -> None:
        """Make flush ``seq`` the first of the checkpoint's rows: earlier ones stop counting,
        and finalize drops them. Call it once every row to keep is in a flush from ``seq`` on;
        it waits for them to be durable before the meta says so."""
        self.flush()
        self.wait_for_writes()
        self.base_seq = seq
        if self.meta is not None:
            self.meta.base_seq = seq
            self.checkpoint.fenced()
            self.checkpoint.meta_file.write(self.meta)

    def flush_before_leaving(self, log: Logger) -> None:
        try:
            self.write_what_is_left()
        except LockHeldError:  # the fence refused every write: this run lost the lock
            unwritten = self._unwritten.height if self._unwritten is not None else 0
            log.error(
                "%d computed row(s) are not stored: this run lost its lock. The writer that "
                "holds it now computes them again.",
                self.buffered_rows + unwritten,
            )
        except Exception as e:  # the original exception matters more
            log.error("Could not flush the last results before stopping: %s", e)

    def write_what_is_left(self) -> None:
        """Write every computed row not yet durable.

        First the rows of a write that failed (a storage error that has passed by now), then the
        buffer."""
        with contextlib.suppress(Exception):  # a failed write: its rows are written again here
            self.wait_for_writes()
        if self._unwritten is not None:
            frame = self._unwritten
            self.checkpoint.write_part(
                frame, int(frame.get_column(SEQ)[0]), id_column=self.id_column
            )
            self._unwritten = None
        self.flush()
        self.wait_for_writes()

    def finish(self, current_ids: pl.Series) -> pl.DataFrame:
        """Merge everything into the merged file; returns the current stored rows.

        The rows still buffered go straight into the merged file, not through a part. Finalize
        would read such a part back, merge and delete it at once: that encodes the rows twice.
        They are no more at risk than while buffered. The run succeeds only once the merged
        file holding them is written. If finalize fails, they are flushed as a part.
        """
        try:
            self.wait_for_writes()
        except BaseException:
            with contextlib.suppress(Exception):  # the write's error is the one to report
                self.write_what_is_left()
            raise
        self.checkpoint.fenced()
        started = time.perf_counter()
        tail = None
        if self.buffer:
            tail = rows.stamped(self.buffered(), self.next_seq)
            self._claim_seq()
        try:
            stored = self.checkpoint.finalize(
                self.id_column, current_ids, self.base_seq, known=self.known, tail=tail
            )
        except BaseException:
            if tail is not None:
                with contextlib.suppress(Exception):  # finalize's error is the one to report
                    seq = int(tail.get_column(SEQ)[0])
                    self.checkpoint.write_part(tail, seq, id_column=self.id_column)
            raise
        if tail is not None and self.contribution is not None:
            self.contribution.durable(tail)
        if not stored.get_column(CURRENT).all():
            stored = stored.filter(pl.col(CURRENT))
        self.finalize_seconds = time.perf_counter() - started
        return stored

    def record_finish(
        self, input_fingerprint: str, counts: dict[str, int], usage: dict[str, float]
    ) -> None:
        if self.meta is not None:
            self.meta.input_fingerprint = input_fingerprint
            self.meta.finalized_at = time.time()
            self.meta.rows = counts
            self.meta.usage = usage
            if self.function_fingerprint is not None:
                self.meta.function_fingerprint = self.function_fingerprint
            self.checkpoint.fenced()
            self.checkpoint.meta_file.write(self.meta)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # never release the lock with a write in flight
        if self.contribution is not None:
            self.contribution.write()  # every row it holds is durable
