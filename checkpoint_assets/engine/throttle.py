"""Rate limits: a shard-wide pause and adaptive concurrency.

A throttle is the endpoint saying "not now": the function raises :class:`RetryAfter`, or an
HTTP error with status 429 or 503 (``httpx.HTTPStatusError``, ``openai.RateLimitError`` and
``openai.APIStatusError``, or anything with ``.response.status_code``). It is not a failure of
the rows: the call does not count as an attempt, marks no row failed and is not part of an
outage streak. Instead every worker of the shard waits until the endpoint's ``Retry-After``
(seconds or an HTTP date; ``retry-after-ms``), or an exponential back-off without one, and then
the same batch is called again.

Concurrency adapts as TCP's congestion window does (AIMD). On a throttle event the calls allowed
in flight halve. They grow by one per two successes while below the level at which the endpoint
last throttled, so a shard gets back quickly, and past it only by one per ``probe`` successes,
so it settles just under the endpoint's limit instead of hammering it; every probe that is
throttled at the same level doubles the wait before the next one. A burst of throttles from
calls that were already in flight when the shard reacted is one event, not many.

A shard throttled for ``max_seconds`` without a single success in between stops: the quota
looks spent, and the run says so after checkpointing what is done.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

THROTTLE_STATUSES = frozenset({429, 503})
MAX_BACKOFF_SECONDS = 60.0
_GROW_BELOW_CEILING = 2  # successes per extra call in flight, up to the last throttled level
_FIRST_PROBE_WINDOWS = 8  # successes per probe past it, in windows of the current limit
_MAX_PROBE_WINDOWS = 512
_POLL_SECONDS = 0.005


class RetryAfter(Exception):
    """Raised by a checkpointed function: the endpoint is rate limiting; call again later.

    Every worker of the shard pauses for ``seconds`` (or an exponential back-off when None), then
    the same batch is called again. It is not an attempt, not a row failure and not an outage.

    Example::

        if response.status_code == 429:
            raise RetryAfter(float(response.headers.get("retry-after", 1)))
    """

    def __init__(self, seconds: float | None = None, message: str = "") -> None:
        self.seconds = None if seconds is None else max(0.0, float(seconds))
        wait = "" if seconds is None else f" (retry after {self.seconds:g} s)"
        super().__init__(message or f"rate limited{wait}")


@dataclass(frozen=True)
class Throttled:
    """A call was throttled; ``seconds`` is what the endpoint asked for, if it said."""

    seconds: float | None
    reason: str


def throttled(error: BaseException) -> Throttled | None:
    """Whether ``error`` is the endpoint rate limiting, and for how long it asked to wait.

    Follows ``__cause__`` (a function that wraps the HTTP error in its own is still throttled).
    """
    seen = 0
    current: BaseException | None = error
    while current is not None and seen < 5:
        if isinstance(current, RetryAfter):
            return Throttled(current.seconds, str(current))
        status, headers = _status_and_headers(current)
        if status in THROTTLE_STATUSES:
            return Throttled(retry_after_seconds(headers), f"HTTP {status}")
        current = current.__cause__
        seen += 1
    return None


def _status_and_headers(error: BaseException) -> tuple[int | None, Any]:
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if status is None:
        status = getattr(error, "status_code", None)
    headers = getattr(response, "headers", None)
    return (status if isinstance(status, int) else None), headers


def retry_after_seconds(headers: Any, now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date)."""
    if not headers:
        return None
    get = headers.get
    ms = get("retry-after-ms") or get("Retry-After-Ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = get("retry-after") or get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(str(value))
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Throttle:
    """The shard's gate: how many calls may be in flight, and when the next may start."""

    def __init__(
        self,
        max_concurrency: int,
        *,
        max_seconds: float,
        base_delay: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max = max(1, max_concurrency)
        self.limit = self.max  # calls allowed in flight now
        self.max_seconds = max_seconds
        self.base_delay = base_delay if base_delay > 0 else 1.0
        self.clock = clock
        self.in_flight = 0
        self.resume_at = 0.0  # no call starts before this (clock time)
        self.events = 0
        self.throttled_seconds = 0.0  # time during which no call could start
        self.spent: str | None = None  # set once the quota looks spent: the shard stops
        self._cond = threading.Condition()
        self._ceiling: int | None = None  # calls in flight at the last throttle event
        self._successes = 0
        self._probe_windows = _FIRST_PROBE_WINDOWS
        self._last_event = -math.inf  # clock time of the last event (calls started before it
        # and throttled after belong to the same burst)
        self._silent_since: float | None = None  # first throttle since the last success
        self._backoffs = 0  # throttles in a row without a Retry-After

    # -- around each call ----------------------------------------------------------------
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
                    return now

    async def acquire_async(self) -> float | None:
        """:meth:`acquire` on an event loop: waits without blocking the loop."""
        while True:
            with self._cond:
                if self.spent is not None:
                    return None
                now = self.clock()
                if now < self.resume_at:
                    wait = self.resume_at - now
                elif self.in_flight >= self.limit:
                    wait = _POLL_SECONDS  # a slot frees when a call ends: look again soon
                else:
                    self.in_flight += 1
                    return now
            await asyncio.sleep(wait)

    def release(self, succeeded: bool) -> None:
        """A call ended (``succeeded``: the endpoint answered, whatever the rows' fate)."""
        with self._cond:
            self.in_flight -= 1
            if succeeded:
                self._silent_since = None
                self._backoffs = 0
                self._grow()
            self._cond.notify_all()

    def throttle(self, started: float, asked: Throttled) -> None:
        """A call that started at ``started`` was throttled: pause the shard, maybe halve."""
        with self._cond:
            self.in_flight -= 1
            now = self.clock()
            if self._silent_since is None:
                self._silent_since = now
            if asked.seconds is None:
                delay = min(self.base_delay * 2**self._backoffs, MAX_BACKOFF_SECONDS)
                self._backoffs += 1
            else:
                delay = asked.seconds
            level = self.in_flight + 1  # calls in flight when this one was refused
            if started >= self._last_event:  # a new event, not the rest of a burst
                self.events += 1
                self._last_event = now
                if self._ceiling is not None and level >= self._ceiling:
                    # A probe past the last throttled level failed again: probe less often.
                    self._probe_windows = min(self._probe_windows * 2, _MAX_PROBE_WINDOWS)
                self._ceiling = level
                self.limit = max(1, min(self.limit, level) // 2)
                self._successes = 0
            elif self._ceiling is not None:
                # The rest of a burst: refused with fewer in flight, the limit is lower still.
                # Concurrency halved once; this sets only how far it grows back quickly.
                self._ceiling = min(self._ceiling, level)
            until = now + delay
            if until > self.resume_at:
                self.throttled_seconds += until - max(self.resume_at, now)
                self.resume_at = until
            silent = until - self._silent_since
            if silent > self.max_seconds:
                self.spent = (
                    f"rate limited for {silent:,.0f} s without a successful call "
                    f"(max_throttle_seconds={self.max_seconds:g}; last: {asked.reason}"
                    + ("" if asked.seconds is None else f", retry after {asked.seconds:g} s")
                    + ")"
                )
            self._cond.notify_all()

    def stop(self) -> None:
        """Wake every waiting worker: the shard stops (an outage, a broken function)."""
        with self._cond:
            if self.spent is None:
                self.spent = ""
            self._cond.notify_all()

    @property
    def quota_spent(self) -> str | None:
        """Why the shard stopped for rate limits (None: it did not)."""
        return self.spent or None

    def _grow(self) -> None:
        if self.limit >= self.max:
            return
        self._successes += 1
        below = self._ceiling is None or self.limit + 1 < self._ceiling
        needed = _GROW_BELOW_CEILING if below else self.limit * self._probe_windows
        if self._successes < needed:
            return
        self._successes = 0
        self.limit += 1
        if self._ceiling is not None and self.limit > self._ceiling:
            # The last throttled level ran a whole probe without a throttle: the endpoint's
            # limit went up. Grow quickly again until the next throttle says where it is.
            self._ceiling = None
            self._probe_windows = _FIRST_PROBE_WINDOWS
