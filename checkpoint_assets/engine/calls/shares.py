"""One budget of a key as a pacer sees it: what is left, how fast it refills, this process's share.

An answer states a budget as a :class:`Limit`. A :class:`Bucket` keeps the budget between answers
and the share of the key's draw this process takes (the rules are ``pacing.py``'s). It imports
nothing of the package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

SHARE_SECONDS = 2.0  # the share of the key's draw is measured over about this long
SHARE_PAIRS = 4  # answers in a row, at least, before the share is measured
MIN_SHARE, MAX_SHARE = 1 / 64, 1.0
MARGIN = 0.95  # of the measured share taken: measurements that add up past 1 cost refusals
DEFAULT_WINDOW = 60.0  # the window of a full budget whose answer gave no reset
TRIP_REFILLED = 0.5  # of a request's round trip, the part after the endpoint stated the key


@dataclass(frozen=True)
class Limit:
    """One budget of a key as one answer states it.

    Attributes:
        limit: what the budget holds when full (per window).
        remaining: what is left of it now.
        reset_seconds: seconds until it is full again.
        steady: it refills steadily until the reset (OpenAI, Anthropic); False: all at once at
            the reset (a fixed window, as the IETF ``RateLimit`` fields describe).
    """

    limit: float
    remaining: float
    reset_seconds: float
    steady: bool = True


class Started(NamedTuple):
    """An answered request as a budget needs it: the order it started in, when, and what this
    process had drawn of the budget by then, this request included."""

    seq: int
    at: float
    drawn: float


class Bucket:
    """One budget of the key, as this process sees it."""

    def __init__(self, stated: Limit, now: float) -> None:
        self.cap = stated.limit
        self.steady = stated.steady
        self.rate = 0.0  # what the key regains per second (steady budgets)
        self.key_rate = 0.0  # the key's whole budget per second, for the record
        self.level = stated.remaining
        self.at = now
        self.reset_at = math.inf  # a fixed window's next reset
        self.share = 1.0  # of the key's draw and refill this process takes
        self.measured = 1.0  # its share of the key's draw, as this process measured it
        self.pooled: float | None = None  # the mean measured share of the key's processes
        self.most = 1.0  # the largest share this process may take: 1 / the processes counted
        self.stated = False  # an answer stated it (else the user did, and it is never reported)
        self.last: tuple[int, float, float, float, float] | None = None  # seq, at, R, own, refused
        self.own_sum = self.key_sum = 0.0
        self.first_at: float | None = None  # when the first answered request started
        self.pairs = 0
        self._restate(stated, now)

    def _restate(self, stated: Limit, now: float) -> None:
        self.cap, self.steady = stated.limit, stated.steady
        missing = stated.limit - stated.remaining
        if stated.steady:
            if missing > 0 and stated.reset_seconds > 0:
                self.rate = missing / stated.reset_seconds
            elif self.rate == 0:
                self.rate = stated.limit / DEFAULT_WINDOW
            self.key_rate = self.rate
        else:
            self.reset_at = now + stated.reset_seconds
            self.key_rate = stated.limit / max(stated.reset_seconds, 1.0)

    @property
    def top(self) -> float:
        """The most this process holds: the budget when full, or its share of an assumed one."""
        return self.cap if self.stated else self.share * self.cap

    def refill(self, now: float) -> None:
        if now <= self.at:
            return
        if self.steady:
            self.level = min(self.top, self.level + self.share * self.rate * (now - self.at))
        elif now >= self.reset_at:
            self.level = max(self.level, self.share * self.cap)
            self.reset_at = math.inf  # the next one comes with the next answer
        self.at = now

    def wait(self, need: float, now: float) -> float:
        """Seconds until ``need`` fits (with :meth:`refill` done to ``now``)."""
        need = min(need, self.top)
        if self.level >= need:
            return 0.0
        if self.steady and self.rate > 0:
            return (need - self.level) / (self.share * self.rate)
        if self.reset_at < math.inf:
            return max(self.reset_at - now, 0.0)
        return 1.0  # a spent fixed window whose reset no answer stated yet: look again soon

    def report(
        self, stated: Limit, ticket: Started, own: float, refused: float, now: float
    ) -> None:
        """An answer to ``ticket`` stated this budget; ``own`` / ``refused``: the pacer's draw
        so far (refused requests drew nothing from the endpoint)."""
        if self.stated and self.last is not None and ticket.seq <= self.last[0]:
            return  # an older statement than the one applied
        self.stated = True
        self._measure(stated, ticket, refused)
        self._restate(stated, now)
        # What this process started after the answered request, the endpoint had not counted.
        pending = own - ticket.drawn
        left = min(stated.remaining, self.cap)
        if self.steady:
            left *= left / self.cap  # the emptier the key, the less of it is taken at once
            if self.pairs >= SHARE_PAIRS:
                # The key refilled while the answer came back. The endpoint stated it between
                # the request's start and now: half that time is taken as refilled. Only with
                # a measured share: shares estimated while shards start add up past 1.
                trip = max(now - ticket.at, 0.0) * TRIP_REFILLED
                left = min(left + self.rate * trip, self.cap)
        self.level = self.share * left - pending
        self.at = now

    def _measure(self, stated: Limit, ticket: Started, refused: float) -> None:
        """This pacer's share of the key's draw, between the last answer applied and this one."""
        own_now = ticket.drawn
        refused_now = refused
        last, self.last = self.last, (ticket.seq, ticket.at, stated.remaining, own_now, refused)
        if not (self.steady and stated.steady) or self.rate <= 0:
            return
        if self.first_at is None:
            self.first_at = ticket.at
        if self.pairs < SHARE_PAIRS:
            # Too few answers to measure: take the key as full when this pacer began, so what
            # it lacks since is what all drew (shards started together share it at once).
            drew = self.cap - stated.remaining + self.rate * (ticket.at - self.first_at)
            if drew > 0:
                self.measured = MARGIN * (own_now - refused_now) / drew
                self._take()
        if last is None:
            return
        _, at, remaining, own, refused_then = last
        dt = max(ticket.at - at, 0.0)
        regained = self.rate * dt
        if remaining + regained >= self.cap:
            return  # full in between: what the key drew is hidden by the cap
        key_drew = remaining + regained - stated.remaining
        own_drew = (own_now - own) - (refused_now - refused_then)
        decay = math.exp(-dt / SHARE_SECONDS)
        self.key_sum = self.key_sum * decay + max(key_drew, 0.0)
        self.own_sum = self.own_sum * decay + max(own_drew, 0.0)
        self.pairs += 1
        if self.pairs >= SHARE_PAIRS and self.key_sum > 0:
            self.measured = MARGIN * self.own_sum / self.key_sum
            self._take()

    def pool(self, most: float, pooled: float | None) -> None:
        """The processes of this machine that call the key: ``most`` is 1 over their count,
        ``pooled`` the mean of the shares they measured (None: none measured yet)."""
        self.most, self.pooled = most, pooled
        self._take()

    def _take(self) -> None:
        """The share taken, never more than an equal part of the processes counted: the mean
        the processes measured, once this one measured its own. Until then, an equal part less
        the margin; alone, its own estimate.

        Any shares that add up to the key are measured back as they are, so measured shares
        that start unequal stay unequal, and the shards end far apart. The mean makes them
        equal; it keeps their sum, which holds what processes of other machines draw. A shard
        that joins others takes an equal part at once: its own estimate counts what the others
        drew before it came as drawn by the key, and stays small."""
        if self.pooled is not None and self.pairs >= SHARE_PAIRS:
            share = self.pooled
        elif self.most < 1:
            share = MARGIN * self.most
        else:
            share = self.measured
        self.share = min(MAX_SHARE, max(MIN_SHARE, min(share, self.most)))
