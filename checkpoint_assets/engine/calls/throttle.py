"""Rate limits: a refused call waits, concurrency follows what the endpoint sustains.

A refusal (``refusals.py``: :class:`RetryAfter`, HTTP 429/503/529, a 5xx with ``Retry-After``)
is not a failure of the rows: the call does not count as an attempt, marks no row failed and is
not part of an outage streak.

Providers refuse a few calls now and then under their own load, whatever the client does, and
some refuse because this shard sends more than they admit. The two call for different answers,
so a single refusal decides nothing:

- **A refused call waits, the others go on.** It is sent again after its ``Retry-After``
  (seconds, an HTTP date, or ``retry-after-ms``), or after its own exponential back-off
  (``retry_delay_seconds`` doubled per refusal in a row) when the endpoint does not say.
- **Concurrency follows the endpoint, judged over rounds.** A round is the next
  ``max(16, 2 × limit)`` answered calls.

  - *When a trial starts.* A round may hold more refusals than is usual for this endpoint (its
    background share), by more than chance explains. Once such rounds at this level add up to
    four refusals at least, the shard halves the calls it allows in flight for as many calls:
    a trial. With fewer refusals, a round at the endpoint's own share would as likely show none.
  - *The refusals went, the answers held.* The refusals fell to an eighth or fewer, and the
    endpoint answers at least three quarters as many calls per second. The extra calls bought
    only refusals: the shard is over a limit and stays at the lower level.
  - *The refusals went, the answers fell.* The limit lies between the two levels, where the
    answers say. That is as many calls as were answered per second before, times the time a
    call takes now.
  - *The refusals stayed.* They are the endpoint's background, whatever the answers did. (A
    client short of CPU answers about as many calls with half of them in flight.) Concurrency
    goes back up. The background share is learned, so that it does not trigger again. The
    next such rounds are taken as background for longer each time a trial says so again.
  - *The learned share* then follows the rounds that were not refused more than usual, up and
    down. It never goes above what the trials found, with what chance hides in one round.
  - *A streak.* Eight refusals in a row (fewer when fewer calls are allowed) halve at once.
    When the level is just past the last good one, the shard goes back to that one instead.
    A streak in a trial ends it: the limit is below even half, and nothing is learned.
- **Growth probes, and steps back only as far as needed.**

  - Clean rounds grow concurrency by a quarter, up to ``max_concurrency``.
  - A level refused for concurrency is remembered for 30 s. Meanwhile a level is good after
    two clean rounds in a row. Growth goes half way to the refused level at most, then one
    more. Past it, growth adds one, two, four... calls at a time, each after one clean round:
    the refused level passed, so the limit moved. Growth is counted in answers, not seconds.
  - Over a limit, refusals can be rare. Calls refused past a limit wait holding their slots.
    An endpoint that queues what it cannot take (a vLLM, a proxy) refuses only now and then.
    So does one called by a client short of CPU: answers wait in the client's own sockets, so
    the endpoint sees fewer calls than the client has in flight. So a shard a few calls over a
    limit sees few refusals. A round with more than usual is no ground to grow on, even with
    too few to mean something alone.
  - A round with clearly more than usual above the last good level steps back to that level,
    with no trial. It tries again after twice as many rounds each time, within 2 s at most.
  - Refused at that good level itself, with a refused level within an eighth above it, the
    shard steps an eighth lower once before any trial. The level a client holds against a
    limit drifts with its own CPU (calls being sent or read count on its side only). A trial
    would cost half the answers of a round.
  - Limits that move back up are found again within seconds.
- **The whole shard pauses only when it is over the limit as a whole**: when at least half the
  calls of a round (or of a streak) were refused, no call starts before the latest
  ``Retry-After``.
- A shard refused for ``max_seconds`` without a single successful call stops: the quota looks
  spent, and the run says so after checkpointing what is done.

``min_concurrency`` is the floor of the adaptation; ``adaptive=False`` keeps ``max_concurrency``
for endpoints whose limit is known (refused calls still wait, and the shard still pauses).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from checkpoint_assets.engine.calls.gate import Gate
from checkpoint_assets.engine.calls.refusals import Throttled

MAX_BACKOFF_SECONDS = 60.0
_MIN_ROUND = 16  # answered calls per round, at least
_SIGMAS = 3.0  # how far above the background a round's refusals must be to mean something
_MIN_MARGIN = 0.02
_KEPT = 0.75  # half the calls in flight kept this share of the answers: a limit, not noise
_TRIAL_REFUSALS = 4  # refusals at one level before a trial can tell them from the background
_CONFIRM = 2  # clean rounds in a row that make a level good, past a refusal
_FORGET_SECONDS = 30.0  # a level refused because of concurrency is remembered this long
_PAUSE_STREAK = 8  # refusals in a row that pause the whole shard
_HOLD_ROUNDS = 8  # clean rounds without growth after the refusals proved to be the endpoint's
_FIRST_PROBE_WAIT = 2  # rounds before a refused level is tried again, doubled per refusal
_MAX_PROBE_WAIT = 64
_MAX_PROBE_SECONDS = 2.0  # however short the rounds, a refused level is tried again this often


class Throttle(Gate):
    """The shard's gate (``gate.py``), its limit following what the endpoint sustains."""

    def __init__(
        self,
        max_concurrency: int,
        *,
        max_seconds: float,
        base_delay: float = 1.0,
        min_concurrency: int = 1,
        adaptive: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(max_concurrency, min_concurrency, clock)
        self.adaptive = adaptive
        self.max_seconds = max_seconds
        self.base_delay = max(0.0, base_delay)
        self.refusals = 0
        self._answered = 0  # calls answered in this round
        self._refused = 0  # of which refused
        self._background = 0.0  # the share of calls the endpoint refuses whatever we do
        self._learned = 0.0  # the background clean rounds show, at most what trials found
        self._found = 0.0  # the highest background a trial found (with its round's spread)
        self._rate = 0.0  # answers per second over recent rounds
        self._round_began = clock()
        self._settling = False  # lowered: the round starts once the calls in flight fit
        self._hold = 0  # clean rounds to wait before growing again
        self._good: int | None = None  # the last level refused no more than usual
        self._probe_wait = _FIRST_PROBE_WAIT  # rounds before probing a refused level again
        self._probe_by = math.inf  # and at the latest then (clock time)
        # Before a trial: the level, answers per second, share refused; calls it lasts.
        self._trial: tuple[int, float, float, int] | None = None
        self._weak = (0, 0, 0)  # rounds refused too few times for a trial: level, calls, refused
        self._ceiling: tuple[int, float] | None = None  # (level refused for concurrency, when)
        self._step = 1  # calls a probe past a refused level adds; doubles with each that passes
        self._clean = (self.max, 0)  # (level, clean rounds in a row there)
        self._nudged = False  # stepped just below a near refused level since the last trial
        self._calm = 0  # rounds a background verdict holds off the next trial (doubling)
        self._calm_left = 0
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
        return self._background

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
        size = max(_MIN_ROUND, 2 * self.limit) if self._trial is None else self._trial[3]
        if self._answered >= size or self._streak >= streak:
            self._end_round(over=self._streak >= streak)

    def _new_round(self) -> None:
        # A streak counts within a round: refusals that ended the last one (or came back from
        # calls started before the limit was lowered) must not lower it again at once.
        self._answered = self._refused = self._streak = 0
        self._round_began = self.clock()

    def _end_round(self, over: bool) -> None:
        now = self.clock()
        share = self._refused / self._answered
        rate = (self._answered - self._refused) / max(now - self._round_began, 1e-6)
        if share >= 0.5:  # most calls refused: the shard as a whole is over the limit
            self._pause(now + self._last_delay, now)
        if self.adaptive:
            if self._trial is None:
                self._rate += (rate - self._rate) / 4 if self._rate else rate
            self._adapt(share, rate, self._answered, over, now)
        self._new_round()

    def _adapt(self, share: float, rate: float, answered: int, over: bool, now: float) -> None:
        """Lower, keep or raise the limit after a round: the cases of the module docstring."""
        self._forget_an_old_refused_level(now)
        if self._trial is not None:
            if over:  # refused in a row with half the calls: a limit below even half, no
                self._trial = None  # background (the streak lowers at once, below)
            elif self._judge_the_trial(share, rate, answered, now):
                return
        if over:
            self._refused_in_a_row(now)
            return
        spread = _spread(self._background, answered)
        excess = share > self._background + max(_MIN_MARGIN, _SIGMAS * spread)
        if self._calm_left:
            self._calm_left -= 1
            if excess:
                return  # a trial just said such refusals are the endpoint's: hold
        if excess:
            self._refused_more_than_usual(answered, now)
            return
        self._follow_the_background(share)
        if share > self._background + spread:
            self._no_ground_to_grow()
            return
        self._clean_round(now)

    # -- the cases of a round --------------------------------------------------------------
    def _forget_an_old_refused_level(self, now: float) -> None:
        """A level refused for concurrency is remembered ``_FORGET_SECONDS``."""
        if self._ceiling is not None and now - self._ceiling[1] > _FORGET_SECONDS:
            self._ceiling = None
            self._probe_wait = _FIRST_PROBE_WAIT

    def _judge_the_trial(self, share: float, rate: float, answered: int, now: float) -> bool:
        """The round at half the calls ends the trial; True when it set the limit.

        The refusals are gone with half the calls when an eighth of them is left at most (a
        round of a fixed background share keeps that few by chance one time in 25 or so)."""
        assert self._trial is not None
        level, before, before_share, _ = self._trial
        self._trial = None
        gone = share <= before_share / 8
        # The endpoint admitted about as many calls as it answered per second before, times
        # the time one takes now (Little's law).
        admitted = round(self.limit * before / rate) if gone and rate > 0 else level
        if gone and rate >= _KEPT * before:
            self._over_a_limit_stay(level, now)
            return False
        if admitted < level:
            self._a_limit_between(level, admitted, now)
            return True
        self._the_refusals_are_the_endpoints(level, share, answered)
        return True

    def _over_a_limit_stay(self, level: int, now: float) -> None:
        """As many answers with half the calls, the refusals gone with the other half: a limit
        below ``level``. Stay. (As many answers and as many refusals: a client short of CPU
        answers as many calls with half in flight; the refusals are the endpoint's.)"""
        self._refused_at(level, now)
        self._good, self._hold = None, 0
        self._calm = 0

    def _a_limit_between(self, level: int, admitted: int, now: float) -> None:
        """Fewer answers, hardly refused: a limit between the two levels, where the answers say.
        (Had it been the background, it costs the few calls up to ``level``: probes go back.)"""
        self._refused_at(level, now)
        self._good, self._hold = admitted, 0
        self._calm = 0
        self._set_limit(admitted)

    def _the_refusals_are_the_endpoints(self, level: int, share: float, answered: int) -> None:
        """The refusals stayed: they are the endpoint's background. Back up to ``level`` and
        learn the background from this round (the round that started the trial was picked for
        its refusals, a biased sample). Stay a few rounds, taking such refusals as background
        for longer each time a trial says so again. What is learned later may reach this
        round's share plus what chance hides in a round of its size."""
        self._found = max(self._found, share + _spread(share, answered))
        self._learned = max(self._learned, share)
        self._background = max(self._background, share)
        self._set_limit(level)
        self._good, self._hold, self._probe_by = level, _HOLD_ROUNDS, math.inf
        self._calm = min(2 * self._calm or _HOLD_ROUNDS, _MAX_PROBE_WAIT)
        self._calm_left = self._calm

    def _refused_in_a_row(self, now: float) -> None:
        """A streak of refusals: over a limit, no doubt. Just past the last good level: back to
        it; else half the calls at once."""
        if self._good is not None and self.limit > self._good:
            self._step_back(now)
            return
        self._refused_at(self.limit, now)
        self._good = None
        self._lower(self.limit // 2)

    def _refused_more_than_usual(self, answered: int, now: float) -> None:
        """More refusals than the background and chance explain."""
        if self._good is not None and self.limit > self._good:
            self._step_back(now)  # refused just past the last good level
        elif not self._nudged and self._ceiling_within(max(2, self.limit // 8)):
            self._an_eighth_lower(now)
        else:
            self._towards_a_trial(answered)

    def _an_eighth_lower(self, now: float) -> None:
        """Refused at a good level just below one refused for concurrency: that limit. An
        eighth lower, once; refused again there, a trial tells."""
        self._nudged = True
        self._refused_at(self.limit, now)
        self._good = None
        self._lower(self.limit - max(1, self.limit // 8))

    def _towards_a_trial(self, answered: int) -> None:
        """Refused at a level that was clean: the endpoint's doing or a new limit? Half the
        calls for as long will tell, once such rounds at this level add up to
        ``_TRIAL_REFUSALS``: with fewer, half the calls at the endpoint's own share would as
        likely show none. Until then the level holds."""
        level = self.limit
        _, calls, refused = self._weak if self._weak[0] == level else (0, 0, 0)
        calls, refused = calls + answered, refused + self._refused
        self._weak = (level, calls, refused)
        self._step = 1
        if refused >= _TRIAL_REFUSALS and self._lower(level // 2):
            self._trial = (level, self._rate, refused / calls, calls)
            self._weak = (0, 0, 0)
            self._nudged = False

    def _follow_the_background(self, share: float) -> None:
        """The background follows rounds not refused more than usual, up and down, never above
        what trials found (refusals of a shard creeping past a limit are not the endpoint's).
        Followed only down, it would settle below the endpoint's share, and the shard would
        hardly grow again."""
        self._background = min(self._learned, self._background + (share - self._background) / 4)
        self._learned = min(self._found, self._learned + (share - self._learned) / 16)

    def _no_ground_to_grow(self) -> None:
        """More refusals than usual, though too few to mean something alone.

        A shard a few calls over a limit sees few refusals: refused calls wait holding their
        slots, and a server that queues, or a client short of CPU, refuses now and then. Such a
        level is not taken for good, and the shard does not grow past it."""
        self._step = 1
        self._clean = (self.limit, 0)

    def _clean_round(self, now: float) -> None:
        """A clean round. Past a refusal (a refused level is remembered), a level is good after
        ``_CONFIRM`` clean rounds in a row: one clean round a few calls over a limit proves
        little. Once a probe past the refused level passed (``_step`` > 1), the limit moved
        up: one clean round makes the next level good. A good level grows, unless a hold
        keeps it."""
        clean = self._clean[1] + 1 if self._clean[0] == self.limit else 1
        self._clean = (self.limit, clean)
        if self._ceiling is not None and clean < (_CONFIRM if self._step == 1 else 1):
            return
        self._good = self.limit
        if self._hold and now < self._probe_by:
            self._hold -= 1
            return
        self._hold = 0
        if self._ceiling is None:
            self._set_limit(self.limit + max(1, self.limit // 4))  # a quarter more per round
        elif self.limit >= self._ceiling[0]:
            self._probe_past_the_refused_level()
        else:
            self._half_way_to_the_refused_level()

    def _probe_past_the_refused_level(self) -> None:
        """A level once refused now passes: the limit moved up, or its refusals were a queue
        overflowing now and then. One more, then twice as many per clean round (a quarter more
        at once would send a burst of refusals), until refused again or it is forgotten."""
        assert self._ceiling is not None
        self._ceiling = (self.limit + 1, self._ceiling[1])
        self._set_limit(self.limit + self._step)
        self._step *= 2

    def _half_way_to_the_refused_level(self) -> None:
        """Below a level refused for concurrency: a quarter more, half way to it at most (the
        range where the endpoint starts refusing halves at each step), then it."""
        assert self._ceiling is not None
        halfway = (self.limit + self._ceiling[0]) // 2
        self._set_limit(max(self.limit + 1, min(self.limit + self.limit // 4, halfway)))

    def _refused_at(self, level: int, now: float) -> None:
        """``level`` was refused for concurrency: growth stops below it for a while. Any hold
        ends: a level held because its refusals were the endpoint's own says nothing of a
        lower one."""
        self._ceiling = (level, now)
        self._step = 1
        self._hold, self._probe_by = 0, math.inf

    def _ceiling_within(self, calls: int) -> bool:
        return self._ceiling is not None and self._ceiling[0] <= self.limit + calls

    def _step_back(self, now: float) -> None:
        """Back to the last good level, and probe past it again later (each failed probe of
        this limit waits twice as many rounds, 2 s at most)."""
        assert self._good is not None
        self._refused_at(self.limit, now)
        self._hold = self._probe_wait
        self._probe_by = now + _MAX_PROBE_SECONDS
        self._probe_wait = min(2 * self._probe_wait, _MAX_PROBE_WAIT)
        self._lower(self._good)

    def _lower(self, limit: int) -> bool:
        lowered = max(self.min, limit)
        if lowered >= self.limit:
            return False
        self.limit = lowered
        self.events += 1
        self._settling = True
        return True


def _spread(share: float, calls: int) -> float:
    """How far chance moves the share refused in a round of ``calls`` (one standard deviation;
    a share under 1 % counts as 1 %, so that a round with none still allows a few)."""
    return math.sqrt(max(share, 0.01) * (1 - share) / calls)
