"""Rate limits: a refused call waits, concurrency follows what the endpoint sustains.

A refusal (``refusals.py``: :class:`RetryAfter`, HTTP 429/503/529, a 5xx with ``Retry-After``)
is not a failure of the rows: the call does not count as an attempt, marks no row failed and is
not part of an outage streak.

- **A refused call waits, the others go on.** It is sent again after its ``Retry-After``
  (seconds, an HTTP date, or ``retry-after-ms``), or after its own exponential back-off
  (``retry_delay_seconds`` doubled per refusal in a row) when the endpoint does not say.
- **Concurrency follows the endpoint, judged over rounds.** A round is the next
  ``max(16, 2 × limit)`` answered calls, or a streak of refusals (eight in a row, fewer when
  fewer calls are allowed). After each, the throttle consults its policy (``adaptation.py``),
  which keeps, lowers or raises the limit; a lowered limit's round starts once the calls in
  flight fit.
- **The whole shard pauses only when it is over the limit as a whole**: when at least half the
  calls of a round (or of a streak) were refused, no call starts before the latest
  ``Retry-After``.
- A shard refused for ``max_throttle_seconds`` without a single successful call stops: the
  quota looks spent, and the run says so after checkpointing what is done.

``min_concurrency`` is the floor of the adaptation; ``adaptive_concurrency=False`` keeps
``max_concurrency`` for endpoints whose limit is known (refused calls still wait, and the shard
still pauses).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from checkpoint_assets.engine.calls.adaptation import Adaptation, NewLimit, Round
from checkpoint_assets.engine.calls.gate import Gate
from checkpoint_assets.engine.calls.refusals import Throttled

MAX_BACKOFF_SECONDS = 60.0
_PAUSE_STREAK = 8  # refusals in a row that end a round (and pause the whole shard)


class Throttling(Protocol):
    """The settings a shard's throttle follows (``Settings`` has them, with their defaults)."""

    @property
    def max_concurrency(self) -> int: ...
    @property
    def min_concurrency(self) -> int: ...
    @property
    def adaptive_concurrency(self) -> bool: ...
    @property
    def retry_delay_seconds(self) -> float: ...
    @property
    def max_throttle_seconds(self) -> float: ...


class Throttle(Gate):
    """The shard's gate (``gate.py``), its limit set by its policy (``adaptation.py``)."""

    def __init__(
        self, settings: Throttling, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(settings.max_concurrency, settings.min_concurrency, clock)
        self.adaptive = settings.adaptive_concurrency
        self.max_seconds = settings.max_throttle_seconds
        self.base_delay = settings.retry_delay_seconds
        self.adaptation = Adaptation(floor=self.min)
        self.refusals = 0
        self._answered = 0  # calls answered in this round
        self._refused = 0  # of which refused
        self._round_began = clock()
        self._settling = False  # lowered: the round starts once the calls in flight fit
        self._streak = 0  # refusals in a row
        self._last_delay = 0.0  # what the latest refusal asked for
        self._silent_since: float | None = None  # first refusal since the last success

    # -- around each call (acquire: ``Gate``) ------------------------------------------------
    def release(self, succeeded: bool) -> None:
        """A call ended (``succeeded``: the endpoint answered, whatever the rows' fate)."""
        with self._cond:
            self.in_flight -= 1
            if succeeded:
                self._silent_since = None
                self._streak = 0
                self._count(refused=False)
            self._wake(1)

    def throttle(self, asked: Throttled, refusals: int = 0) -> float:
        """A call was refused (``refusals`` times in a row before): returns how long it waits,
        keeping its slot, before it queues again with ``release(False)``."""
        with self._cond:
            self.refusals += 1
            now = self.clock()
            if self._silent_since is None:
                self._silent_since = now
            if asked.seconds is None:
                delay = min(self.base_delay * 2.0**refusals, MAX_BACKOFF_SECONDS)
            else:
                delay = asked.seconds
            self._last_delay = delay
            self._streak += 1
            self._count(refused=True)
            silent = now + delay - self._silent_since
            if silent > self.max_seconds:
                self.spent = (
                    f"rate limited for {silent:,.0f} s without a successful call "
                    f"(max_throttle_seconds={self.max_seconds:g}; last: {asked.reason}"
                    + ("" if asked.seconds is None else f", retry after {asked.seconds:g} s")
                    + ")"
                )
                self._wake(None)
            return delay

    @property
    def background(self) -> float:
        """The share of calls the endpoint refuses whatever the shard does, as learned."""
        return self.adaptation.shares.background

    # -- inside the lock -------------------------------------------------------------------
    def _count(self, refused: bool) -> None:
        """One answered call towards the round; judge the round when it is complete."""
        if self._settling:
            if self.in_flight > self.limit:
                return  # calls started before the limit was lowered say nothing of it
            self._settling = False
            self._new_round()
        self._answered += 1
        self._refused += refused
        streak = max(2, min(_PAUSE_STREAK, self.limit))
        if self._answered >= self.adaptation.round_size(self.limit) or self._streak >= streak:
            self._end_round(over=self._streak >= streak)

    def _new_round(self) -> None:
        # A streak counts within a round: refusals that ended the last one (or came back from
        # calls started before the limit was lowered) must not lower it again at once.
        self._answered = self._refused = self._streak = 0
        self._round_began = self.clock()

    def _end_round(self, over: bool) -> None:
        now = self.clock()
        done = Round(self._answered, self._refused, now - self._round_began, over)
        if done.share >= 0.5:  # most calls refused: the shard as a whole is over the limit
            self._pause(now + self._last_delay, now)
        if self.adaptive:
            self._apply(self.adaptation.judge(done, self.limit, now))
        self._new_round()

    def _apply(self, new: NewLimit | None) -> None:
        if new is None:
            return
        if not new.cut:
            self._set_limit(new.level)
            return
        self.limit = new.level
        self.events += 1
        self._settling = True
