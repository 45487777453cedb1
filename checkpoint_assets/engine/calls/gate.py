"""The shard's gate: how many calls may be in flight, and when the next may start.

Worker threads wait in :meth:`Gate.acquire`; tasks on one event loop in :meth:`Gate.acquire_async`,
which waits on a future instead of polling. The limit and the pauses are decided by
``throttle.py``; this is only the waiting. A call it admits runs with the shard's pacing record
(``pacing.py``): its requests wait there for the key's budget and count in the shard's record.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable

from checkpoint_assets.engine.calls import pacing


class Gate:
    """Calls in flight up to ``limit``, none before ``resume_at``, none once ``spent`` is set."""

    def __init__(
        self, max_concurrency: int, min_concurrency: int, clock: Callable[[], float]
    ) -> None:
        self.max = max(1, max_concurrency)
        self.min = min(max(1, min_concurrency), self.max)
        self.limit = self.max  # calls allowed in flight now
        self.clock = clock
        self.in_flight = 0
        self.resume_at = 0.0  # no call starts before this (clock time)
        self.events = 0  # times the shard lowered its concurrency or paused as a whole
        self.throttled_seconds = 0.0  # time during which the whole shard was paused
        self.spent: str | None = None  # set once the quota looks spent: the shard stops
        self.pacing = pacing.Record()  # what the shard's requests drew and waited for budget
        self._cond = threading.Condition()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def acquire(self) -> float | None:
        """Wait for a free slot and the end of any pause; returns the call's start time, or
        None when the shard stops (the quota looks spent)."""
        with self._cond:
            while True:
                if self.spent is not None:
                    return None
                now = self.clock()
                if now < self.resume_at:
                    self._cond.wait(self.resume_at - now)
                elif self.in_flight >= self.limit:
                    self._cond.wait()
                else:
                    self.in_flight += 1
                    pacing.attach(self.pacing)
                    return now

    async def acquire_async(self) -> float | None:
        """:meth:`acquire` on an event loop: waits without blocking the loop."""
        while True:
            waiter: asyncio.Future[None] | None = None
            with self._cond:
                if self.spent is not None:
                    return None
                now = self.clock()
                if now < self.resume_at:
                    wait = self.resume_at - now
                elif self.in_flight >= self.limit:
                    waiter = asyncio.get_running_loop().create_future()
                    self._waiters.append(waiter)
                else:
                    self.in_flight += 1
                    pacing.attach(self.pacing)
                    return now
            if waiter is None:
                await asyncio.sleep(wait)
            else:
                await waiter  # woken when a slot frees, the limit grows or the shard stops

    def stop(self) -> None:
        """Wake every waiting worker: the shard stops (an outage, a broken function)."""
        with self._cond:
            if self.spent is None:
                self.spent = ""
            self._wake(None)

    @property
    def quota_spent(self) -> str | None:
        """Why the shard stopped for rate limits (None: it did not)."""
        return self.spent or None

    # -- inside the lock -------------------------------------------------------------------
    def _wake(self, slots: int | None) -> None:
        """Wake ``slots`` waiters (None: all of them)."""
        self._cond.notify_all()
        while self._waiters and (slots is None or slots > 0):
            waiter = self._waiters.popleft()
            if waiter.done():
                continue
            waiter.get_loop().call_soon_threadsafe(_set_done, waiter)
            if slots is not None:
                slots -= 1

    def _pause(self, until: float, now: float) -> None:
        if until > self.resume_at:
            if now >= self.resume_at:
                self.events += 1  # a new pause, not a longer one
            self.throttled_seconds += until - max(self.resume_at, now)
            self.resume_at = until

    def _set_limit(self, limit: int) -> None:
        limit = min(self.max, max(self.min, limit))
        grown = limit - self.limit
        self.limit = limit
        if grown > 0:
            self._wake(grown)


def _set_done(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
