"""The run loop: resume, call the function batch by batch, flush, compact, finalize.

``run()`` is the whole life of one checkpointed run, free of Dagster::

    prepare()      validate ids, hash every input row
    Session.open   take the lock, check the job, load what is stored, plan the rest
    Session.work   call the function on batches of ``checkpoint_interval`` rows (threads or
                   asyncio when ``max_concurrency > 1``); flush every interval rows or
                   ``flush_seconds``: a background thread writes the part and compacts, one
                   flush in flight; on any exception, SIGTERM or SIGINT, flush what is done
                   before leaving
    Session.close  finalize: merge the parts and the last buffered rows into the merged file,
                   write meta, release the lock

A hard kill loses at most the rows buffered since the last flush plus the flush in flight.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl

from checkpoint_assets.engine import hashing
from checkpoint_assets.engine.calls import BatchFn, Caller, Outcome, outage_threshold
from checkpoint_assets.engine.checkpoint import (
    ATTEMPTS,
    BOOKKEEPING,
    CURRENT,
    ERROR,
    INPUT_HASH,
    SEQ,
    Checkpoint,
    Meta,
    Part,
    Stored,
    pick_winners,
)
from checkpoint_assets.engine.errors import (
    CorruptCheckpointError,
    JobMismatchError,
    OutageError,
    TooManyFailuresError,
)
from checkpoint_assets.engine.lock import DEFAULT_LEASE_SECONDS, Lease
from checkpoint_assets.engine.resume import OnInputChange, Plan, plan, validate_ids

log = logging.getLogger("checkpoint_assets")


@dataclass(frozen=True)
class Settings:
    """How one run behaves. Only ``job_settings()`` fields change results."""

    id_column: str
    input_columns: tuple[str, ...]
    checkpoint_interval: int = 16
    flush_seconds: float = 30.0
    min_flush_seconds: float = 0.0
    resume: bool = True
    checkpointing: bool = True
    retry_failed: bool = True
    on_input_change: OnInputChange = "fail"
    dedupe: bool = False
    max_failed_fraction: float = 0.0
    max_concurrency: int = 1
    max_attempts: int = 3
    retry_delay_seconds: float = 1.0
    progress_seconds: float = 10.0
    lease_seconds: float = DEFAULT_LEASE_SECONDS


@dataclass
class RunStats:
    """What a run did; becomes the materialization's metadata."""

    rows_total: int = 0
    rows_computed: int = 0
    rows_resumed: int = 0
    rows_failed: int = 0
    rows_reused: int = 0
    rows_dropped: int = 0
    rows_changed: int = 0
    rows_imported: int = 0
    calls: int = 0
    failed_calls: int = 0
    flushes: int = 0
    seconds: float = 0.0
    # How long storage held the run up: waiting for the flush in flight, and finalize. The
    # background writer's own time overlaps the calls and is not counted.
    wait_seconds: float = 0.0
    finalize_seconds: float = 0.0
    input_fingerprint: str = ""
    checkpoint_path: str = ""
    requests: dict[str, int] = field(default_factory=dict)

    @property
    def rows_per_second(self) -> float:
        return round(self.rows_computed / self.seconds, 2) if self.seconds > 0 else 0.0

    @property
    def storage_wait_seconds(self) -> float:
        """How long checkpointing held the run up: waits for flushes, then finalize."""
        return round(self.wait_seconds + self.finalize_seconds, 3)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rows_per_second"] = self.rows_per_second
        out["storage_wait_seconds"] = self.storage_wait_seconds
        return out


def prepare(df: pl.DataFrame, settings: Settings) -> pl.DataFrame:
    """Validate ids and return id + input columns with each row's ``_input_hash``."""
    validate_ids(df, settings.id_column)
    missing = [c for c in settings.input_columns if c not in df.columns]
    if missing:
        raise CorruptCheckpointError(
            f"Input columns {missing} are not in the input (columns: {df.columns})."
        )
    columns = [settings.id_column, *settings.input_columns]
    frame = df.select(columns)
    if frame.schema[settings.id_column].is_integer():
        frame = frame.with_columns(pl.col(settings.id_column).cast(pl.Int64))
    hashes = hashing.row_hashes(frame, columns)
    return frame.with_columns(pl.Series(INPUT_HASH, hashes, dtype=pl.UInt64))


def run(
    fn: BatchFn,
    inputs: pl.DataFrame,
    checkpoint: Checkpoint | None,
    settings: Settings,
    *,
    job: Mapping[str, Any],
    scheme: Mapping[str, Any] | None = None,
    run_id: str | None = None,
    is_run_finished: Any = None,
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None,
    label: str = "",
    imported: pl.DataFrame | None = None,
) -> tuple[pl.DataFrame, RunStats]:
    """Run ``fn`` over ``inputs`` (already ``prepare()``d) with resume and checkpointing.

    Returns the result (id, outputs, ``_error``; one row per input id) and the run's stats.
    With ``checkpointing`` off, ``checkpoint`` is ignored and nothing is read or written.
    ``imported``: finished rows from other checkpoints of the same job (global resume); those
    whose id and input hash match a row of ``inputs`` are copied into this checkpoint and skipped.
    """
    session = Session(
        fn,
        inputs,
        checkpoint if settings.checkpointing else None,
        settings,
        job=dict(job),
        scheme=dict(scheme) if scheme else None,
        run_id=run_id,
        is_run_finished=is_run_finished,
        logger=logger or log,
        label=label,
        imported=imported,
    )
    return session.execute()


class Session:
    """One run against one checkpoint (see the module docstring)."""

    def __init__(
        self,
        fn: BatchFn,
        inputs: pl.DataFrame,
        checkpoint: Checkpoint | None,
        settings: Settings,
        *,
        job: dict[str, Any],
        scheme: dict[str, Any] | None,
        run_id: str | None,
        is_run_finished: Any,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        label: str,
        imported: pl.DataFrame | None = None,
    ) -> None:
        self.fn = fn
        self.inputs = inputs
        self.checkpoint = checkpoint
        self.s = settings
        self.job = job
        self.scheme = scheme
        self.run_id = run_id
        self.is_run_finished = is_run_finished
        self.log = logger
        self.label = label
        self.id = settings.id_column
        self.stats = RunStats(rows_total=inputs.height)
        self.meta: Meta | None = None
        self.base_seq = 0
        self.next_seq = 1
        self.parts: list[Part] = []
        self.lease: Lease | None = None
        # Rows computed but not yet flushed, and the in-memory result without checkpointing.
        self.buffer: list[pl.DataFrame] = []
        self.buffered_rows = 0
        self.kept: list[pl.DataFrame] = []
        self.suspect: list[pl.DataFrame] = []
        self.last_flush = time.monotonic()
        self.started = time.monotonic()
        self.last_progress = self.started
        self.done_rows = 0
        self.failed_rows = 0  # rows this run stored as failed (for progress lines)
        self.todo_rows = 0
        self.output_columns: list[str] | None = None
        self.copies: pl.DataFrame | None = None
        self._outage_at = outage_threshold(settings.max_attempts, settings.checkpoint_interval)
        self._last_error = ""
        self.imported = imported
        # What open() loaded, reused by finalize while this run has written nothing.
        self.known: Stored | None = None
        # Parts are written by one background thread, at most one flush in flight (see flush).
        self.writer: cf.ThreadPoolExecutor | None = None
        self.writing: cf.Future[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def execute(self) -> tuple[pl.DataFrame, RunStats]:
        self.stats.input_fingerprint = hashing.fingerprint(
            self.inputs.get_column(INPUT_HASH).to_numpy()
        )
        if self.checkpoint is not None:
            self.stats.checkpoint_path = self.checkpoint.url
            self.lease = Lease(
                self.checkpoint.store,
                self.checkpoint.lock_path,
                run_id=self.run_id,
                lease_seconds=self.s.lease_seconds,
                is_run_finished=self.is_run_finished,
            )
            self.lease.acquire()
        try:
            work = self.open()
            with _sigterm_as_interrupt():
                try:
                    stopped = self.work(work)
                except BaseException:
                    self._flush_quietly()
                    raise
            return self.close(stopped)
        finally:
            if self.writer is not None:
                self.writer.shutdown(wait=True)  # never release the lock with a write in flight
            if self.lease is not None:
                self.lease.release()
            if self.checkpoint is not None:
                self.stats.requests = dict(self.checkpoint.store.requests)

    def open(self) -> pl.DataFrame:
        """Check the stored job, load stored rows, plan the work; returns the rows to compute."""
        stored = pl.DataFrame()
        fingerprint = hashing.job_fingerprint(self.job)
        id_dtype = str(self.inputs.schema[self.id])
        if self.checkpoint is not None:
            self.meta = self.checkpoint.read_meta()
            if self.meta is not None:
                self._check_job(self.meta, fingerprint, id_dtype)
            base = self.meta.base_seq if self.meta else 0
            same_job = self.meta is not None and self.meta.job_fingerprint == fingerprint
            outputs = self.meta.output_schema if self.meta is not None and same_job else None
            loaded = self.checkpoint.load(self.id, base, list(outputs) if outputs else None)
            self.next_seq = loaded.next_seq
            self.parts = [p for p in loaded.parts]
            stored = loaded.rows
            fresh = not self.s.resume or (
                self.meta is not None and self.meta.job_fingerprint != fingerprint
            )
            if self.meta is not None and fresh:
                # resume: false ignores what is stored (which may even be another job's, with
                # other output columns): start a new generation.
                self.base_seq = self.next_seq
                stored = stored.clear()
            else:
                self.base_seq = base
                self.known = loaded
            self._check_stored_columns(stored)
            if self.meta is None or fresh:
                self.meta = Meta(
                    job_fingerprint=fingerprint,
                    job=self.job,
                    id_column=self.id,
                    id_dtype=id_dtype,
                    output_schema=None,
                    scheme=self.scheme,
                    base_seq=self.base_seq,
                )
                self.checkpoint.write_meta(self.meta)
            if self.meta.output_schema:
                self.output_columns = list(self.meta.output_schema)
            if self.imported is not None and self.s.resume:
                stored = self._import(stored, self.imported)
        p = plan(
            self.inputs,
            stored,
            self.id,
            resume=self.s.resume,
            retry_failed=self.s.retry_failed,
            on_input_change=self.s.on_input_change,
        )
        self._record_plan(p, stored)
        todo = p.todo
        if self.s.dedupe and todo.height:
            todo = self._dedupe(todo)
        self.todo_rows = p.todo.height
        return todo

    def _import(self, stored: pl.DataFrame, imported: pl.DataFrame) -> pl.DataFrame:
        """Copy matching finished rows of other checkpoints into this one (one part)."""
        assert self.checkpoint is not None
        if self.id not in imported.columns or imported.height == 0:
            return stored
        imported = imported.with_columns(pl.col(self.id).cast(self.inputs.schema[self.id]))
        wanted = imported.join(
            self.inputs.select(self.id, INPUT_HASH), on=[self.id, INPUT_HASH], how="semi"
        )
        if stored.height:
            done = stored.filter(pl.col(ERROR).is_null()).select(self.id, INPUT_HASH)
            wanted = wanted.join(done, on=[self.id, INPUT_HASH], how="anti")
        if wanted.height == 0:
            return stored
        self._learn_schema(wanted)
        seq = self.next_seq
        rows = wanted.with_columns(
            pl.lit(None, pl.String).alias(ERROR),
            pl.col(ATTEMPTS).fill_null(0).cast(pl.Int32),
            pl.lit(seq, pl.Int64).alias(SEQ),
        )
        part = self.checkpoint.write_part(rows, seq)
        self.next_seq += 1
        self.known = None
        self.parts = self.checkpoint.compact([*self.parts, part], self.id)
        self.stats.rows_imported = rows.height
        self.log.info(
            "%s: global resume took %d finished row(s) from other checkpoints.",
            self.label or "checkpoint",
            rows.height,
        )
        merged = pl.concat([stored, rows], how="diagonal_relaxed") if stored.height else rows
        return pick_winners(merged, self.id)

    def _check_job(self, meta: Meta, fingerprint: str, id_dtype: str) -> None:
        if meta.id_column != self.id or (meta.job_fingerprint != fingerprint and self.s.resume):
            changed = sorted(
                k for k in set(meta.job) | set(self.job) if meta.job.get(k) != self.job.get(k)
            )
            raise JobMismatchError(
                f"Checkpoint {self.stats.checkpoint_path} was written by a different job "
                f"(settings that differ: {', '.join(changed) or 'id column'}). Results of one "
                "job are never mixed with another's. Use a new `checkpoint_tag` for this job, or "
                "run with `resume: false` to replace the stored results."
            )
        if meta.id_dtype != id_dtype and self.s.resume:
            raise JobMismatchError(
                f"Checkpoint {self.stats.checkpoint_path} stores ids of type {meta.id_dtype}, "
                f"but the input's {self.id!r} is {id_dtype}. Cast the id column back to "
                f"{meta.id_dtype}, or use a new `checkpoint_tag`."
            )

    def _check_stored_columns(self, stored: pl.DataFrame) -> None:
        if self.meta is None or not self.meta.output_schema or stored.height == 0:
            return
        ok = stored.filter(pl.col(ERROR).is_null())
        missing = [c for c in self.meta.output_schema if c not in stored.columns]
        if ok.height and missing:
            raise CorruptCheckpointError(
                f"Checkpoint {self.stats.checkpoint_path} lacks the output columns {missing}. "
                "Two different jobs probably share this checkpoint: give each its own "
                "`checkpoint_tag`, or start over with `resume: false`."
            )

    def _record_plan(self, p: Plan, stored: pl.DataFrame) -> None:
        self.stats.rows_resumed = p.resumed
        self.stats.rows_dropped = p.dropped
        self.stats.rows_changed = p.changed
        if p.dropped:
            self.log.warning(
                "%s: %d stored row(s) are not in the input and are left out of the result "
                "(they stay stored and come back if their ids return).",
                self.label or "checkpoint",
                p.dropped,
            )
        if p.changed:
            self.log.warning(
                "%s: recomputing %d row(s) whose input changed.",
                self.label or "checkpoint",
                p.changed,
            )
        if p.resumed or p.kept_failed:
            self.log.info(
                "%s: resuming; %d of %d rows are done, %d to compute.",
                self.label or "checkpoint",
                p.resumed,
                p.total,
                p.todo.height,
            )

    def _dedupe(self, todo: pl.DataFrame) -> pl.DataFrame:
        key = hashing.row_hashes(todo, list(self.s.input_columns))
        keyed = todo.with_columns(pl.Series("__key", key, dtype=pl.UInt64))
        reps = keyed.unique(subset=["__key"], keep="first", maintain_order=True)
        self.copies = (
            keyed.join(reps.select(pl.col(self.id).alias("__rep"), "__key"), on="__key")
            .filter(pl.col(self.id) != pl.col("__rep"))
            .select(self.id, "__rep", INPUT_HASH, ATTEMPTS)
        )
        return reps.drop("__key")

    # -- the work loop -------------------------------------------------------------------
    def work(self, todo: pl.DataFrame) -> str | None:
        """Process ``todo``; returns why it stopped early (an outage), or None."""
        caller = Caller(
            self.fn,
            self.id,
            max_attempts=self.s.max_attempts,
            retry_delay_seconds=self.s.retry_delay_seconds,
            outage_after=self._outage_at,
        )
        try:
            for outcome in self._outcomes(caller, todo):
                if caller.outage:
                    # Failures seen during an outage say nothing about the rows; results of
                    # calls that succeeded before it (batches still in flight) are kept.
                    self.suspect.clear()
                    outcome.failed.clear()
                self._absorb(outcome)
                self._maybe_flush()
                self._maybe_progress()
        finally:
            caller.close()
        if caller.outage:
            self.suspect.clear()
            return caller.last_error or "every call failed"
        self._commit(self.suspect)
        self.suspect = []
        return None

    def _outcomes(self, caller: Caller, todo: pl.DataFrame) -> Iterator[Outcome]:
        size = max(1, self.s.checkpoint_interval)
        batches = (todo.slice(i, size) for i in range(0, todo.height, size))
        if self.s.max_concurrency <= 1:
            for batch in batches:
                yield caller.process(batch)
                if caller.outage:
                    return
            return
        pool = cf.ThreadPoolExecutor(self.s.max_concurrency, thread_name_prefix="checkpoint")
        pending: set[cf.Future[Outcome]] = set()
        try:
            for batch in batches:
                while len(pending) >= self.s.max_concurrency:
                    done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                    yield from (f.result() for f in done)
                if caller.outage:
                    break  # an outage: submit nothing more, collect the batches in flight
                pending.add(pool.submit(caller.process, batch))
            while pending:
                done, pending = cf.wait(
                    pending, timeout=self.s.flush_seconds, return_when=cf.FIRST_COMPLETED
                )
                yield from (f.result() for f in done)
                if not done:
                    self._maybe_flush()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _absorb(self, outcome: Outcome) -> None:
        self.stats.calls += outcome.calls
        self.stats.failed_calls += outcome.failed_calls
        if outcome.ok:
            self._learn_schema(outcome.ok[0])
            self._commit(self.suspect + outcome.ok + outcome.failed)
            self.suspect = []
        else:
            self.suspect.extend(outcome.failed)
        if outcome.failed:
            last = outcome.failed[-1]
            self._last_error = str(last.get_column(ERROR)[-1])

    def _learn_schema(self, rows: pl.DataFrame) -> None:
        outputs = {
            c: str(t) for c, t in rows.schema.items() if c != self.id and c not in BOOKKEEPING
        }
        if self.output_columns is None:
            if self.checkpoint is not None:
                Checkpoint.check_storable(rows.head(1))
            self.output_columns = list(outputs)
            if self.meta is not None and self.checkpoint is not None:
                self.meta.output_schema = outputs
                self.checkpoint.write_meta(self.meta)
            return
        if list(outputs) != self.output_columns:
            raise JobMismatchError(
                f"The function now returns the columns {list(outputs)}, but the checkpoint "
                f"{self.stats.checkpoint_path or ''} holds results with {self.output_columns}. "
                "A changed output schema is a different job: set a new `code_version` or "
                "`checkpoint_tag`, or run with `resume: false`."
            )

    def _commit(self, frames: Sequence[pl.DataFrame]) -> None:
        frames = [f for f in frames if f.height]
        if not frames:
            return
        rows = pl.concat(frames, how="diagonal_relaxed")
        computed = rows.height
        if self.copies is not None and self.copies.height:
            rows = pl.concat([rows, self._copies_of(rows)], how="diagonal_relaxed")
        self.stats.rows_computed += computed
        self.stats.rows_reused += rows.height - computed
        self.done_rows += rows.height
        self.failed_rows += rows.height - rows.get_column(ERROR).null_count()
        self.buffer.append(rows)
        self.buffered_rows += rows.height

    def _copies_of(self, rows: pl.DataFrame) -> pl.DataFrame:
        assert self.copies is not None
        values = rows.drop(INPUT_HASH, ATTEMPTS).rename({self.id: "__rep"})
        return (
            self.copies.join(values, on="__rep", how="inner")
            .drop("__rep")
            .with_columns(pl.col(ATTEMPTS).cast(pl.Int32))
        )

    # -- flushing ------------------------------------------------------------------------
    def _maybe_flush(self) -> None:
        since = time.monotonic() - self.last_flush
        due = self.buffered_rows >= self.s.checkpoint_interval or since >= self.s.flush_seconds
        if due and self.buffered_rows and since >= self.s.min_flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Hand the buffered rows to the background writer as one part (with checkpointing).

        The writer writes the part, then compacts, while the function works on the next batch.
        At most one flush is in flight: a flush first waits for the previous one (and raises its
        error), so a hard kill loses at most the buffer plus that flush. While it waits, it
        encodes its own part, so a function faster than the writer keeps both threads busy.
        ``close`` waits for the last one before finalizing: a run never succeeds before its rows
        are durable.
        """
        if not self.buffer:
            return
        rows = self._buffered()
        if self.checkpoint is None:
            self._claim()
            self.kept.append(rows)
            return
        seq = self.next_seq
        rows = _stamped(rows, seq)
        data = None
        if self.writing is not None and not self.writing.done():
            data = self.checkpoint.encode_part(rows)  # the writer is busy: use the wait
        self.wait_for_writes()  # its error leaves the buffer as it is
        if self.lease is not None:
            self.lease.check()  # a writer that lost its lock writes nothing more
        self._claim()
        if self.writer is None:
            self.writer = cf.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self.writing = self.writer.submit(self._write, rows, seq, data)

    def _buffered(self) -> pl.DataFrame:
        return (
            self.buffer[0]
            if len(self.buffer) == 1
            else pl.concat(self.buffer, how="diagonal_relaxed")
        )

    def _claim(self) -> None:
        """The buffered rows now belong to a flush: empty the buffer, take a sequence number."""
        self.buffer, self.buffered_rows = [], 0
        self.last_flush = time.monotonic()
        if self.checkpoint is not None:
            self.next_seq += 1
            self.stats.flushes += 1
            self.known = None

    def _write(self, rows: pl.DataFrame, seq: int, data: bytes | None) -> None:
        """The writer thread's job: one part (``data``, if encoded already), then compaction."""
        assert self.checkpoint is not None
        part = self.checkpoint.write_part(rows, seq, data=data)
        self.parts = self.checkpoint.compact([*self.parts, part], self.id)

    def wait_for_writes(self) -> None:
        """Block until the flush in flight is durable; raise its error if it failed."""
        writing, self.writing = self.writing, None
        if writing is not None:
            started = time.perf_counter()
            try:
                writing.result()
            finally:
                self.stats.wait_seconds += time.perf_counter() - started

    def _flush_quietly(self) -> None:
        try:
            self.flush()
            self.wait_for_writes()
        except Exception as e:  # the original exception matters more
            self.log.error("Could not flush the last results before stopping: %s", e)

    def _maybe_progress(self) -> None:
        now = time.monotonic()
        if now - self.last_progress < self.s.progress_seconds:
            return
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
            f"{self.label or 'checkpoint'}: {done:,} / {self.stats.rows_total:,} rows "
            f"({100 * done / total:.1f}%), {rate:,.1f} rows/s, ETA {eta}, "
            f"{self.failed_rows:,} failed, {self.stats.rows_reused:,} reused"
        )

    # -- the end -------------------------------------------------------------------------
    def close(self, stopped: str | None) -> tuple[pl.DataFrame, RunStats]:
        if self.checkpoint is None:
            self.flush()
            rows = pl.concat(self.kept, how="diagonal_relaxed") if self.kept else pl.DataFrame()
        else:
            rows = self._finalize()
        self.stats.seconds = time.monotonic() - self.started
        result = self._result(rows)
        self.stats.rows_failed = int(result.get_column(ERROR).is_not_null().sum())
        if self.checkpoint is not None and self.meta is not None:
            self.meta.input_fingerprint = self.stats.input_fingerprint
            self.meta.finalized_at = time.time()
            self.meta.rows = {
                "total": self.stats.rows_total,
                "ok": result.height - self.stats.rows_failed,
                "failed": self.stats.rows_failed,
            }
            self.checkpoint.write_meta(self.meta)
        self.log.info("%s", self.progress_line(time.monotonic()))
        if stopped is not None:
            raise OutageError(
                f"{self.label or 'checkpoint'}: stopped early after {self._outage_at} calls in a "
                f"row failed (last error: {stopped}). The endpoint looks down or the quota is "
                f"spent; the {self.done_rows:,} rows done before are checkpointed and the rest "
                "were not marked failed. Run again when it is back: the run resumes."
            )
        self._check_failures()
        return result, self.stats

    def _finalize(self) -> pl.DataFrame:
        """Merge everything into the merged file; returns the current stored rows.

        The rows still buffered go straight into the merged file rather than through a part
        that finalize would read back, merge and delete at once: that would encode them twice.
        They are no more at risk than while buffered, and the run succeeds only once the
        merged file holding them is written. If finalize fails, they are flushed as a part.
        """
        assert self.checkpoint is not None
        self.wait_for_writes()
        if self.lease is not None:
            self.lease.check()
        started = time.perf_counter()
        tail = None
        if self.buffer:
            tail = _stamped(self._buffered(), self.next_seq)
            self._claim()
        current = self.inputs.get_column(self.id)
        try:
            rows = self.checkpoint.finalize(
                self.id, current, self.base_seq, known=self.known, tail=tail
            )
        except BaseException:
            if tail is not None:
                with contextlib.suppress(Exception):  # finalize's error is the one to report
                    self.checkpoint.write_part(tail, int(tail.get_column(SEQ)[0]))
            raise
        if not rows.get_column(CURRENT).all():
            rows = rows.filter(pl.col(CURRENT))
        self.stats.finalize_seconds = time.perf_counter() - started
        return rows

    def _result(self, rows: pl.DataFrame) -> pl.DataFrame:
        outputs = self.output_columns or [
            c for c in rows.columns if c != self.id and c not in BOOKKEEPING
        ]
        if rows.height == 0 or self.id not in rows.columns:
            schema: dict[str, Any] = {self.id: self.inputs.schema[self.id]}
            schema |= {c: pl.Null for c in outputs}
            schema[ERROR] = pl.String
            return pl.DataFrame(schema=schema)
        for c in [*outputs, ERROR]:
            if c not in rows.columns:
                rows = rows.with_columns(pl.lit(None).alias(c))
        return rows.select(self.id, *outputs, ERROR)

    def _check_failures(self) -> None:
        failed = self.stats.rows_failed
        if not failed:
            return
        fraction = failed / max(self.stats.rows_total, 1)
        if fraction > self.s.max_failed_fraction:
            raise TooManyFailuresError(
                f"{self.label or 'checkpoint'}: {failed:,} of {self.stats.rows_total:,} rows "
                f"failed ({fraction:.2%}), more than max_failed_fraction="
                f"{self.s.max_failed_fraction:.2%}. Every other row is checkpointed; the failed "
                f"rows are retried on the next run (last error: {self._last_error or 'stored'})."
            )


def _stamped(rows: pl.DataFrame, seq: int) -> pl.DataFrame:
    """``rows`` with the ``_seq`` of the flush that stores them."""
    return rows.with_columns(pl.lit(seq, pl.Int64).alias(SEQ))


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
