"""Calling the user's function on a batch: validation, rate limits, retries, poison rows, outages.

Three kinds of trouble, each handled its own way:

- **Rate limits** (``RetryAfter``, HTTP 429/503/529; see throttle.py) delay the refused call,
  then call the same batch again: not an attempt, not a failure, not part of an outage streak;
  the shard's concurrency follows what the endpoint sustains.
- **A broken function** (called with a signature it does not have; a result that is not a table,
  lacks the id column, repeats ids or returns ids that were not asked for; an ``AttributeError``
  on a real object, a ``NameError``, an ``ImportError``) cannot be fixed by retrying: the first
  occurrence stops the shard, after what is done is checkpointed.
- **Anything else** may be transient. A batch whose call raises is retried ``max_attempts`` times
  with a doubling delay. If it keeps failing it is split in halves, each tried once, recursively,
  until the rows that fail alone are found; those are stored as failures (``_error``,
  ``_attempts``) while their neighbours succeed.

An outage (endpoint down) makes every call fail. Splitting would then call once per row, so the
caller counts consecutive failed calls of rows not tried before (stored failures retried on a
later run are expected to fail again and do not count): at ``outage_threshold`` (more than a
single poison row can cause) it declares an outage, every batch in flight stops, and the run
stops with ``OutageError``; the failures seen during that streak are not stored, since they say
nothing about the rows. With several calls in flight, only a success of a call that started
after the streak began ends it: a slow call that started before the endpoint went down proves
nothing.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
import types
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import polars as pl
import pyarrow as pa

from checkpoint_assets.engine.rows import ATTEMPTS, BOOKKEEPING, ERROR, INPUT_HASH, NO_RESULT
from checkpoint_assets.engine.throttle import Throttle, throttled

BatchFn = Callable[[pl.DataFrame], Any]
_MAX_ERROR_CHARS = 2000


T = TypeVar("T")
# What a step waits for, and for what: a slot of the shard's gate, a delay, a call.
_ACQUIRE, _SLEEP, _CALL = "acquire", "sleep", "call"
Steps = Generator[tuple[str, Any], Any, T]


class Broken(Exception):
    """The function is broken: retrying cannot help."""


def outage_threshold(max_attempts: int, batch_rows: int) -> int:
    """Consecutive failed calls that mean an outage rather than poison rows.

    Isolating one poison row in a batch of ``b`` rows fails at most ``max_attempts + log2(b)``
    calls in a row; two adjacent poison rows one more. Twice the splitting depth leaves margin.
    """
    return max_attempts + 2 * math.ceil(math.log2(max(batch_rows, 2))) + 1


@dataclass
class Outcome:
    """Rows produced by processing one batch: successes and failures, plus call counts."""

    ok: list[pl.DataFrame] = field(default_factory=list)
    failed: list[pl.DataFrame] = field(default_factory=list)
    calls: int = 0
    failed_calls: int = 0
    throttled_calls: int = 0


class Caller:
    """Calls ``fn`` on batches, sync or async, with rate limits, retries and splitting."""

    def __init__(
        self,
        fn: BatchFn,
        id_column: str,
        *,
        max_attempts: int = 3,
        retry_delay_seconds: float = 1.0,
        outage_after: int | None = None,
        throttle: Throttle | None = None,
    ) -> None:
        self.fn = fn
        self.id_column = id_column
        self.max_attempts = max(1, max_attempts)
        self.retry_delay_seconds = retry_delay_seconds
        self.outage_after = outage_after  # consecutive failed calls that mean an outage
        self.throttle = throttle or Throttle(1, max_seconds=math.inf)
        self.outage = False  # declared once; every batch in flight then stops
        self.broken: str | None = None  # what is wrong with the function, once seen
        self.last_error = ""  # of the latest failed call, for messages
        self._lock = threading.Lock()
        self._started = 0  # calls started so far; each call's number orders it
        self._streak = 0  # consecutive failed calls
        self._streak_began = 0  # calls started when the streak's first failure was seen
        self._columns: list[str] | None = None  # what the function sees of a batch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        if inspect.iscoroutinefunction(fn):
            self._start_loop()

    @property
    def stopping(self) -> bool:
        """The shard stops: an outage, a broken function, or the quota looks spent."""
        return self.outage or self.broken is not None or self.throttle.spent is not None

    # -- the event loop of an ``async def`` function ---------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop an ``async def`` function runs on (None for a plain function)."""
        return self._loop

    def _start_loop(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
        self._loop_thread.start()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout=5)
            self._loop.close()
            self._loop = None

    def _call_fn(self, batch: pl.DataFrame) -> Any:
        # The one place the function is called (a coroutine comes back for ``async def``):
        # a TypeError raised right here is a signature that does not fit the call.
        return self.fn(batch)

    # -- drivers: the steps below, run by threads or by the event loop ---------------------
    def process(self, batch: pl.DataFrame) -> Outcome:
        """Results for every row of ``batch`` (rows the function skipped count as failed).

        For an ``async def`` function this blocks the calling thread while the event loop
        runs :meth:`aprocess`.
        """
        if self._loop is not None:
            return asyncio.run_coroutine_threadsafe(self.aprocess(batch), self._loop).result()
        steps = self._process(batch)
        value: Any = None
        error: Exception | None = None
        while True:
            try:
                kind, arg = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            value, error = None, None
            if kind == _ACQUIRE:
                value = self.throttle.acquire()
            elif kind == _SLEEP:
                time.sleep(arg)
            else:
                try:
                    value = self._call_fn(arg)
                except Exception as e:
                    error = e

    async def aprocess(self, batch: pl.DataFrame) -> Outcome:
        """:meth:`process` for an ``async def`` function, on its event loop."""
        steps = self._process(batch)
        value: Any = None
        error: Exception | None = None
        while True:
            try:
                kind, arg = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            value, error = None, None
            if kind == _ACQUIRE:
                value = await self.throttle.acquire_async()
            elif kind == _SLEEP:
                await asyncio.sleep(arg)
            else:
                try:
                    value = await self._call_fn(arg)
                except Exception as e:
                    error = e

    # -- checking a result ---------------------------------------------------------------
    def _check(self, raw: Any, batch: pl.DataFrame) -> pl.DataFrame:
        out = _as_frame(raw)
        if out is None:
            raise Broken(
                f"it returned {type(raw).__name__}; it must return a polars DataFrame "
                f"with the id column {self.id_column!r} and the output columns"
            )
        if self.id_column not in out.columns:
            raise Broken(
                f"its result has no id column {self.id_column!r} "
                f"(columns: {out.columns}); return the id with each result"
            )
        reserved = [c for c in out.columns if c in BOOKKEEPING]
        if reserved:
            raise Broken(f"its result uses reserved column names {reserved}")
        ids = out.get_column(self.id_column)
        wanted = batch.get_column(self.id_column)
        if ids.dtype == wanted.dtype and ids.equals(wanted):
            return out  # the batch's own ids in its order (the usual case): nothing to check
        if ids.null_count():
            raise Broken("it returned results with a null id")
        if ids.n_unique() != out.height:
            raise Broken("it returned more than one result for some ids")
        if ids.dtype != wanted.dtype:
            try:
                out = out.with_columns(pl.col(self.id_column).cast(wanted.dtype, strict=True))
            except Exception as e:
                raise Broken(f"it returned ids of type {ids.dtype}: {e}") from e
        unknown = out.join(batch.select(self.id_column), on=self.id_column, how="anti")
        if unknown.height:
            sample = unknown.get_column(self.id_column).head(5).to_list()
            raise Broken(f"it returned ids that were not in its batch: {sample}")
        return out

    # -- the outage breaker --------------------------------------------------------------
    def _start(self) -> int:
        with self._lock:
            self._started += 1
            return self._started

    def _finish(self, ok: bool, number: int, counts: bool = True) -> bool:
        """Count a finished call (``number`` from ``_start``); False once there is an outage.

        A failed call of rows that all failed before (a retry of stored failures) does not
        ``count`` towards an outage: poison rows are expected to fail again.
        """
        with self._lock:
            if not ok and not counts:
                return not self.outage
            if ok and number > self._streak_began:
                self._streak = 0
            elif not ok:
                if self._streak == 0:
                    self._streak_began = self._started
                self._streak += 1
                outage = self.outage_after is not None and self._streak >= self.outage_after
                if outage and not self.outage:
                    self.outage = True
                    self.throttle.stop()
            return not self.outage

    # -- the steps of a batch: rate limits, retries and splitting ------------------------
    # Written once as generators that yield what to wait for (a slot, a delay, a call); the
    # drivers above run them with threads or on the event loop.
    def _process(self, batch: pl.DataFrame) -> Steps[Outcome]:
        outcome = Outcome()
        yield from self._attempt(batch, self.max_attempts, 0, outcome)
        return outcome

    def _call(self, batch: pl.DataFrame, outcome: Outcome) -> Steps[pl.DataFrame | str | None]:
        """One call through the shard's gate, again and again while it is rate limited.

        Returns the result, the error of a failed call, or None when the shard stops.
        """
        if self._columns is None:
            self._columns = [c for c in batch.columns if c not in BOOKKEEPING]
        refusals = 0  # of this call in a row
        while True:
            started = yield (_ACQUIRE, None)
            if started is None or self.stopping:
                if started is not None:
                    self.throttle.release(False)
                return None
            number = self._start()
            try:
                raw = yield (_CALL, batch[self._columns])
                out = self._check(raw, batch)
            except Broken as e:
                self._broke(str(e))
                return None
            except Exception as e:
                asked = throttled(e)
                if asked is not None:
                    outcome.throttled_calls += 1
                    delay = self.throttle.throttle(asked, refusals)
                    refusals += 1
                    if delay > 0:
                        # This call waits, keeping its slot so no other call takes its place;
                        # the others go on. Then it queues again (a pause, a lowered limit).
                        yield (_SLEEP, delay)
                    self.throttle.release(False)
                    continue
                if _is_bug(e, Caller._call_fn.__code__):
                    self._broke(_describe(e))
                    return None
                self.throttle.release(False)
                outcome.calls += 1
                outcome.failed_calls += 1
                self.last_error = _describe(e)
                fresh = bool(batch.get_column(ATTEMPTS).min() == 0)  # a row never tried before
                return self.last_error if self._finish(False, number, fresh) else None
            self.throttle.release(True)
            outcome.calls += 1
            self._finish(True, number)  # a result paid for is kept, outage or not
            return out

    def _broke(self, problem: str) -> None:
        self.throttle.release(False)
        with self._lock:
            if self.broken is None:
                self.broken = problem
        self.throttle.stop()

    def _attempt(
        self, batch: pl.DataFrame, attempts: int, before: int, outcome: Outcome
    ) -> Steps[bool]:
        """Try ``batch`` up to ``attempts`` times, then split. False when the run must stop.

        ``before`` counts the calls that already included these rows (for ``_attempts``).
        """
        error = ""
        for attempt in range(attempts):
            if attempt:
                yield (_SLEEP, self.retry_delay_seconds * 2 ** (attempt - 1))
            got = yield from self._call(batch, outcome)
            if got is None:
                return False
            if isinstance(got, str):
                error = got
                continue
            used = before + attempt + 1
            outcome.ok.append(_successes(got, batch, self.id_column, used))
            if got.height < batch.height:  # its ids are unique and from the batch (checked)
                missing = batch.join(got.select(self.id_column), on=self.id_column, how="anti")
                outcome.failed.append(_failures(missing, self.id_column, NO_RESULT, used))
            return not self.stopping
        used = before + attempts
        if batch.height == 1:
            outcome.failed.append(_failures(batch, self.id_column, error, used))
            return True
        half = batch.height // 2
        if not (yield from self._attempt(batch.head(half), 1, used, outcome)):
            return False
        return (yield from self._attempt(batch.slice(half), 1, used, outcome))


def _is_bug(e: BaseException, call_site: types.CodeType) -> bool:
    """Whether an exception from the function cannot be transient."""
    if isinstance(e, TypeError):
        return _raised_at(e, call_site)  # the function was called with arguments it does not take
    if isinstance(e, AttributeError):
        return getattr(e, "obj", None) is not None  # a real object lacks it: a typo, a wrong API
    return isinstance(e, NameError | ImportError)


def _raised_at(e: BaseException, call_site: types.CodeType) -> bool:
    """Whether ``e`` was raised by calling the function, before any of its code ran."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code is call_site


def _as_frame(raw: Any) -> pl.DataFrame | None:
    if isinstance(raw, pl.DataFrame):
        return raw
    if isinstance(raw, pl.LazyFrame):
        return raw.collect()
    if isinstance(raw, (pa.Table, pa.RecordBatch)):
        frame = pl.from_arrow(raw)
        return frame if isinstance(frame, pl.DataFrame) else None
    if isinstance(raw, dict):
        return pl.DataFrame(raw)
    return None


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


_NO_ERROR = pl.Series(ERROR, [None], dtype=pl.String)


def _successes(out: pl.DataFrame, batch: pl.DataFrame, id_column: str, used: int) -> pl.DataFrame:
    if out.get_column(id_column).equals(batch.get_column(id_column)):  # same ids, same order
        attempts = batch.get_column(ATTEMPTS)
        return out.hstack(  # plain Series: a tenth of the cost of expressions on small batches
            [
                (attempts + used)
                if attempts.dtype == pl.Int32
                else (attempts + used).cast(pl.Int32),
                batch.get_column(INPUT_HASH),
                _NO_ERROR if out.height == 1 else _NO_ERROR.new_from_index(0, out.height),
            ]
        )
    joined = out.join(batch.select(id_column, ATTEMPTS, INPUT_HASH), on=id_column, how="left")
    return joined.with_columns(
        pl.lit(None, pl.String).alias(ERROR),
        (pl.col(ATTEMPTS) + used).cast(pl.Int32).alias(ATTEMPTS),
    )


def _failures(rows: pl.DataFrame, id_column: str, error: str, used: int) -> pl.DataFrame:
    return rows.select(
        id_column,
        INPUT_HASH,
        pl.lit(error, pl.String).alias(ERROR),
        (pl.col(ATTEMPTS) + used).cast(pl.Int32).alias(ATTEMPTS),
    )
