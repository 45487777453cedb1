"""Calling the user's function on a batch: validation, rate limits, retries, poison rows, outages.

Three kinds of trouble, each handled its own way:

- **Rate limits** (``RetryAfter``, HTTP 429/503/529; see throttle.py) delay the refused call.
  Then the same batch is called again. That is not an attempt, not a failure and not part of an
  outage streak. The shard's concurrency follows what the endpoint sustains.
- **A broken function** cannot be fixed by retrying. It is called with a signature it does not
  have. Or its result is not a table, lacks the id column, repeats ids or returns ids not asked
  for. Or it raises an ``AttributeError`` on a real object, a ``NameError`` or an
  ``ImportError``. The first occurrence stops the shard, after what is done is checkpointed.
- **Anything else** may be transient. A batch whose call raises is retried ``max_attempts`` times
  with a doubling delay. If it keeps failing, it is split in halves, each tried once,
  recursively. That finds the rows that fail alone. They are stored as failures (``_error``,
  ``_attempts``) while their neighbours succeed.
- **Rows failed for good** (``RowFailed``): the endpoint answered, but the rows cannot succeed.
  They are stored failed at once, with no retry, and the call counts as answered for the outage
  breaker below.

An outage (endpoint down) makes every call fail, and splitting would then call once per row. So
the caller counts consecutive failed calls of rows not tried before. Stored failures retried on
a later run are expected to fail again, and do not count. At ``outage_threshold`` (more than a
single poison row can cause) the caller declares an outage:

- every batch in flight stops, and the run stops with ``OutageError``;
- the failures seen during that streak are not stored, since they say nothing about the rows.

With several calls in flight, only a success of a call that started after the streak began ends
it. A slow call that started before the endpoint went down proves nothing.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
import types
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import polars as pl

from checkpoint_assets.engine.calls.batches import (
    Batch,
    Broken,
    Check,
    PerRow,
    Record,
    RowFailed,
    batches,
)
from checkpoint_assets.engine.calls.budget import Spend
from checkpoint_assets.engine.calls.refusals import quota_spent, throttled
from checkpoint_assets.engine.calls.throttle import Throttle

BatchFn = Callable[[pl.DataFrame], Any]
_MAX_ERROR_CHARS = 2000

T = TypeVar("T")
_Got = tuple[Record, pl.DataFrame | None]  # a checked result, and failures of rows it skipped


def outage_threshold(max_attempts: int, batch_rows: int) -> int:
    """Consecutive failed calls that mean an outage rather than poison rows.

    Isolating one poison row in a batch of ``b`` rows fails at most ``max_attempts + log2(b)``
    calls in a row; two adjacent poison rows one more. Twice the splitting depth leaves margin.
    """
    return max_attempts + 2 * math.ceil(math.log2(max(batch_rows, 2))) + 1


@dataclass
class Outcome:
    """What processing one batch produced: results (records, see batches.py), stored failures,
    and call counts."""

    ok: list[Record] = field(default_factory=list)
    failed: list[pl.DataFrame] = field(default_factory=list)
    calls: int = 0
    failed_calls: int = 0
    throttled_calls: int = 0


class Calling(Protocol):
    """The settings the caller follows (``Settings`` has them, with their defaults)."""

    @property
    def id_column(self) -> str: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def retry_delay_seconds(self) -> float: ...
    @property
    def batch_rows(self) -> int: ...


class Caller:
    """Calls ``fn`` on batches, sync or async, with rate limits, retries and splitting.

    ``fn`` takes a frame of rows, or one row as a dict when it is wrapped in :class:`PerRow`.
    Its calls go through the shard's ``throttle``.
    """

    def __init__(
        self,
        fn: BatchFn | PerRow,
        settings: Calling,
        *,
        throttle: Throttle,
        spend: Spend | None = None,
        halt: Callable[[], str | None] | None = None,
    ) -> None:
        self.per_row = isinstance(fn, PerRow)
        self.fn: Callable[[Any], Any] = fn.fn if isinstance(fn, PerRow) else fn
        self.id_column = settings.id_column
        self.check = Check(self.id_column)
        self.max_attempts = settings.max_attempts
        self.retry_delay_seconds = settings.retry_delay_seconds
        # Consecutive failed calls that mean an outage.
        self.outage_after = outage_threshold(settings.max_attempts, settings.batch_rows)
        self.throttle = throttle
        self.spend = spend  # a budget's tally: no call starts once it is spent
        self.halt = halt  # why no call may start (the lock lost, the run over), or None
        self.outage = False  # declared once; every batch in flight then stops
        self.broken: str | None = None  # what is wrong with the function, once seen
        self.quota: str | None = None  # the quota the provider said is spent, once seen
        self.last_error = ""  # of the latest failed call, for messages
        self._lock = threading.Lock()
        self._started = 0  # calls started so far; each call's number orders it
        self._streak = 0  # consecutive failed calls
        self._streak_began = 0  # calls started when the streak's first failure was seen
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._blocking = not inspect.iscoroutinefunction(self.fn)
        if not self._blocking:
            self._start_loop()

    @property
    def stopping(self) -> bool:
        """The shard stops: an outage, a broken function, the quota looks spent, the budget,
        or ``halt`` says so."""
        spent = self.spend is not None and self.spend.stopped
        if self.outage or self.broken is not None or self.throttle.spent is not None or spent:
            return True
        return self.halt is not None and self.halt() is not None

    def batches(self, todo: pl.DataFrame, size: int) -> Iterator[Batch]:
        """The batches of ``todo`` as this function takes them (see batches.py)."""
        return batches(todo, self.id_column, size, self.per_row)

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

    # -- the drivers: the steps below, on a worker thread or on the event loop --------------
    # The steps are written once, as coroutines. What they wait for (a slot of the shard's
    # gate, a delay, a call) blocks a worker thread for a plain function, so there they never
    # suspend and run to their end without an event loop; for an ``async def`` function they
    # are awaited on its event loop. These three waits are the whole difference.
    def process(self, batch: Batch) -> Outcome:
        """Results for every row of ``batch`` (rows the function skipped count as failed).

        For an ``async def`` function this blocks the calling thread while the event loop
        runs :meth:`aprocess`.
        """
        if self._loop is not None:
            return asyncio.run_coroutine_threadsafe(self.aprocess(batch), self._loop).result()
        return run_blocking(self.aprocess(batch))

    async def aprocess(self, batch: Batch) -> Outcome:
        """:meth:`process` as a coroutine (on the event loop of an ``async def`` function)."""
        outcome = Outcome()
        await self._attempt(batch, self.max_attempts, 0, outcome)
        return outcome

    async def _acquire(self) -> float | None:
        if self._blocking:
            return self.throttle.acquire()
        return await self.throttle.acquire_async()

    async def _sleep(self, seconds: float) -> None:
        if self._blocking:
            time.sleep(seconds)
        else:
            await asyncio.sleep(seconds)

    async def _invoke(self, argument: Any) -> Any:
        if self._blocking:
            return self._call_fn(argument)
        return await self._call_fn(argument)

    def _call_fn(self, argument: Any) -> Any:
        # The one place the function is called (a coroutine comes back for ``async def``):
        # a TypeError raised right here is a signature that does not fit the call.
        return self.fn(argument)

    # -- the outage breaker --------------------------------------------------------------
    def _start(self) -> int:
        with self._lock:
            self._started += 1
            return self._started

    def _finish(self, ok: bool, number: int, counts: bool = True) -> bool:
        """Count a finished call (``number`` from ``_start``); False once there is an outage.

        A failed call of rows that all failed before (a retry of stored failures) does not
        ``count`` towards an outage. Poison rows are expected to fail again.
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
                outage = self._streak >= self.outage_after
                if outage and not self.outage:
                    self.outage = True
                    self.throttle.stop()
            return not self.outage

    # -- the steps of a batch: rate limits, retries and splitting ------------------------
    async def _call(
        self, batch: Batch, used: int, outcome: Outcome
    ) -> _Got | str | pl.DataFrame | None:
        """One call through the shard's gate, again and again while it is rate limited.

        Returns the checked result (and the failures of rows it skipped), the error of a
        failed call, the rows failed for good (``RowFailed``), or None when the shard stops.
        ``used``: calls of these rows, this one too.
        """
        refusals = 0  # of this call in a row
        while True:
            started = await self._acquire()
            if started is None or self.stopping:
                if started is not None:
                    self.throttle.release(False)
                return None
            number = self._start()
            try:
                raw = await self._invoke(batch.argument)
                got = batch.results(raw, used, self.check)
            except Broken as e:
                self._broke(str(e))
                return None
            except RowFailed as e:  # answered, so no outage; retrying cannot help
                self.throttle.release(True)
                outcome.calls += 1
                self._finish(True, number)
                return batch.failures(str(e), used, self.id_column)
            except Exception as e:
                spent = quota_spent(e)
                if spent is not None:  # waiting or retrying cannot help: stop the shard
                    self.quota = self.quota or spent
                    self._broke(spent)
                    return None
                asked = throttled(e)
                if asked is not None:
                    outcome.throttled_calls += 1
                    delay = self.throttle.throttle(asked, refusals)
                    refusals += 1
                    if delay > 0:
                        # This call waits, keeping its slot so no other call takes its place;
                        # the others go on. Then it queues again (a pause, a lowered limit).
                        await self._sleep(delay)
                    self.throttle.release(False)
                    continue
                if _is_bug(e, Caller._call_fn.__code__):
                    self._broke(_describe(e))
                    return None
                self.throttle.release(False)
                outcome.calls += 1
                outcome.failed_calls += 1
                self.last_error = _describe(e)
                fresh = batch.fresh  # a row never tried before
                return self.last_error if self._finish(False, number, fresh) else None
            self._pay(got[0])  # before its slot is free: no call starts on a stale spend
            self.throttle.release(True)
            outcome.calls += 1
            self._finish(True, number)  # a result paid for is kept, outage or not
            return got

    def _pay(self, record: Record) -> None:
        """Count a result's cost; once the budget is spent, wake the calls waiting to start.

        Each sees ``stopping`` and starts nothing. The calls in flight finish and are kept."""
        if self.spend is None:
            return
        self.spend.add_record(record)
        if self.spend.stopped:
            self.throttle.stop()

    def _broke(self, problem: str) -> None:
        self.throttle.release(False)
        with self._lock:
            if self.broken is None:
                self.broken = problem
        self.throttle.stop()

    async def _attempt(self, batch: Batch, attempts: int, before: int, outcome: Outcome) -> bool:
        """Try ``batch`` up to ``attempts`` times, then split. False when the run must stop.

        ``before`` counts the calls that already included these rows (for ``_attempts``).
        """
        error = ""
        for attempt in range(attempts):
            if attempt:
                await self._sleep(self.retry_delay_seconds * 2 ** (attempt - 1))
            got = await self._call(batch, before + attempt + 1, outcome)
            if got is None:
                return False
            if isinstance(got, str):
                error = got
                continue
            if isinstance(got, pl.DataFrame):
                outcome.failed.append(got)
                return not self.stopping
            record, missing = got
            outcome.ok.append(record)
            if missing is not None:
                outcome.failed.append(missing)
            return not self.stopping
        used = before + attempts
        if batch.height == 1:
            outcome.failed.append(batch.failures(error, used, self.id_column))
            return True
        head, tail = batch.halves()
        if not await self._attempt(head, 1, used, outcome):
            return False
        return await self._attempt(tail, 1, used, outcome)


def run_blocking(steps: Coroutine[Any, Any, T]) -> T:
    """Run steps whose every wait blocks the thread: they never suspend, so need no event loop."""
    try:
        steps.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    steps.close()
    raise RuntimeError("a step of a plain function waited on an event loop")


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


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."
