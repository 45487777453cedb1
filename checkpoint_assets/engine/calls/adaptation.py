"""How a shard's concurrency follows what the endpoint sustains: the policy its throttle consults.

The throttle (``throttle.py``) counts answered calls in rounds: a round is the next
``max(16, 2 × limit)`` answered calls, or a streak of refusals. After each round it hands the
round to :class:`Adaptation`, with the limit the round ran at and the time, and applies the
:class:`NewLimit` it answers. The policy holds no lock, reads no clock and knows no gate, so it
can be driven alone, round by round.

Providers refuse a few calls now and then under their own load, whatever the client does, and
some refuse because this shard sends more than they admit. The two call for different answers,
so a single refusal decides nothing; concurrency is judged over rounds:

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

Growth probes, and steps back only as far as needed:

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

``min_concurrency`` is the floor it lowers to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_ROUND = 16  # answered calls per round, at least
_SIGMAS = 3.0  # how far above the background a round's refusals must be to mean something
_MIN_MARGIN = 0.02
_KEPT = 0.75  # half the calls in flight kept this share of the answers: a limit, not noise
_TRIAL_REFUSALS = 4  # refusals at one level before a trial can tell them from the background
_CONFIRM = 2  # clean rounds in a row that make a level good, past a refusal
_FORGET_SECONDS = 30.0  # a level refused because of concurrency is remembered this long
_HOLD_ROUNDS = 8  # clean rounds without growth after the refusals proved to be the endpoint's
_FIRST_PROBE_WAIT = 2  # rounds before a refused level is tried again, doubled per refusal
_MAX_PROBE_WAIT = 64
_MAX_PROBE_SECONDS = 2.0  # however short the rounds, a refused level is tried again this often


def round_size(limit: int) -> int:
    """Answered calls in a round at ``limit`` (a trial's round is as long as what started it)."""
    return max(MIN_ROUND, 2 * limit)


@dataclass(frozen=True)
class Round:
    """One round as the throttle counted it."""

    answered: int  # calls answered, refusals included
    refused: int
    seconds: float  # from its first call's answer to its last
    over: bool  # it ended with a streak of refusals

    @property
    def share(self) -> float:
        """The share of its calls refused."""
        return self.refused / self.answered

    @property
    def rate(self) -> float:
        """Calls answered (not refused) per second."""
        return (self.answered - self.refused) / max(self.seconds, 1e-6)


@dataclass(frozen=True)
class NewLimit:
    """The calls the gate allows in flight from now on (clamped by it to its bounds).

    ``cut``: lowered for refusals, already at or above the floor. The shard counts it as an
    event, and the next round starts once the calls in flight fit."""

    level: int
    cut: bool = False


@dataclass(frozen=True)
class Trial:
    """Half the calls for a round, to tell a limit from the endpoint's own refusals."""

    level: int  # the level that was refused, to go back to
    rate: float  # calls answered per second before
    share: float  # the share refused before, over the rounds that started it
    calls: int  # answered calls the trial lasts: as many as those rounds


@dataclass(frozen=True)
class Tally:
    """Rounds at one level refused more than usual, too few times yet for a trial."""

    level: int = 0
    calls: int = 0
    refused: int = 0


@dataclass(frozen=True)
class Ceiling:
    """A level refused for concurrency, and when (clock time)."""

    level: int
    at: float


@dataclass(frozen=True)
class CleanRun:
    """Clean rounds in a row at one level."""

    level: int = 0
    rounds: int = 0


@dataclass
class Shares:
    """The share of calls the endpoint refuses whatever the shard does."""

    background: float = 0.0  # taken as the endpoint's own now
    learned: float = 0.0  # what clean rounds show, at most ``found``
    found: float = 0.0  # the highest share a trial found, with its round's spread

    def follow(self, share: float) -> None:
        """A round not refused more than usual moves the background towards its ``share``, up
        and down, never above what trials found (refusals of a shard creeping past a limit are
        not the endpoint's). Followed only down, it would settle below the endpoint's share,
        and the shard would hardly grow again."""
        self.background = min(self.learned, self.background + (share - self.background) / 4)
        self.learned = min(self.found, self.learned + (share - self.learned) / 16)

    def learn(self, share: float, answered: int) -> None:
        """A trial found ``share`` (of ``answered`` calls) to be the endpoint's own. What is
        learned later may reach it plus what chance hides in a round of its size."""
        self.found = max(self.found, share + spread(share, answered))
        self.learned = max(self.learned, share)
        self.background = max(self.background, share)


class Adaptation:
    """After each round: the limit to keep (None), lower or raise to (see the module)."""

    def __init__(self, floor: int) -> None:
        self.floor = floor  # the fewest calls in flight it lowers to
        self.shares = Shares()
        self.rate = 0.0  # answers per second over recent rounds (not trials)
        self.good: int | None = None  # the last level refused no more than usual
        self.trial: Trial | None = None
        self.tally = Tally()
        self.ceiling: Ceiling | None = None
        self.clean = CleanRun()
        self.hold = 0  # clean rounds to wait before growing again
        self.probe_wait = _FIRST_PROBE_WAIT  # rounds before probing a refused level again
        self.probe_by = math.inf  # and at the latest then (clock time)
        self.step = 1  # calls a probe past a refused level adds; doubles with each that passes
        self.nudged = False  # stepped just below a near refused level since the last trial
        self.calm = 0  # rounds a background verdict holds off the next trial (doubling)
        self.calm_left = 0

    def round_size(self, limit: int) -> int:
        """Answered calls in the next round at ``limit``."""
        return round_size(limit) if self.trial is None else self.trial.calls

    def judge(self, done: Round, limit: int, now: float) -> NewLimit | None:
        """The round ``done`` ran at ``limit`` and ended at ``now``: what the limit becomes."""
        if self.trial is None:
            self.rate += (done.rate - self.rate) / 4 if self.rate else done.rate
        self._forget_an_old_refused_level(now)
        if self.trial is not None:
            if done.over:  # refused in a row with half the calls: a limit below even half, no
                self.trial = None  # background (the streak lowers at once, below)
            elif (judged := self._judge_the_trial(done, limit, now)) is not None:
                return judged
        if done.over:
            return self._refused_in_a_row(limit, now)
        return self._by_its_refusals(done, limit, now)

    def _by_its_refusals(self, done: Round, limit: int, now: float) -> NewLimit | None:
        """A round that was no streak, judged against the background and chance."""
        background = self.shares.background
        chance = spread(background, done.answered)
        excess = done.share > background + max(_MIN_MARGIN, _SIGMAS * chance)
        if self.calm_left:
            self.calm_left -= 1
            if excess:
                return None  # a trial just said such refusals are the endpoint's: hold
        if excess:
            return self._refused_more_than_usual(done, limit, now)
        self.shares.follow(done.share)
        if done.share > self.shares.background + chance:
            self._no_ground_to_grow(limit)
            return None
        return self._clean_round(limit, now)

    # -- the cases of a round --------------------------------------------------------------
    def _forget_an_old_refused_level(self, now: float) -> None:
        """A level refused for concurrency is remembered ``_FORGET_SECONDS``."""
        if self.ceiling is not None and now - self.ceiling.at > _FORGET_SECONDS:
            self.ceiling = None
            self.probe_wait = _FIRST_PROBE_WAIT

    def _judge_the_trial(self, done: Round, limit: int, now: float) -> NewLimit | None:
        """The round at half the calls ends the trial; None when the round is to be judged on
        as any other (over a limit, the lower level stays).

        The refusals are gone with half the calls when an eighth of them is left at most (a
        round of a fixed background share keeps that few by chance one time in 25 or so)."""
        assert self.trial is not None
        trial, self.trial = self.trial, None
        gone = done.share <= trial.share / 8
        # The endpoint admitted about as many calls as it answered per second before, times
        # the time one takes now (Little's law).
        rate = done.rate
        admitted = round(limit * trial.rate / rate) if gone and rate > 0 else trial.level
        if gone and rate >= _KEPT * trial.rate:
            self._over_a_limit_stay(trial.level, now)
            return None
        if admitted < trial.level:
            return self._a_limit_between(trial.level, admitted, now)
        return self._the_refusals_are_the_endpoints(trial.level, done)

    def _over_a_limit_stay(self, level: int, now: float) -> None:
        """As many answers with half the calls, the refusals gone with the other half: a limit
        below ``level``. Stay. (As many answers and as many refusals: a client short of CPU
        answers as many calls with half in flight; the refusals are the endpoint's.)"""
        self._refused_at(level, now)
        self.good, self.hold = None, 0
        self.calm = 0

    def _a_limit_between(self, level: int, admitted: int, now: float) -> NewLimit:
        """Fewer answers, hardly refused: a limit between the two levels, where the answers say.
        (Had it been the background, it costs the few calls up to ``level``: probes go back.)"""
        self._refused_at(level, now)
        self.good, self.hold = admitted, 0
        self.calm = 0
        return NewLimit(admitted)

    def _the_refusals_are_the_endpoints(self, level: int, done: Round) -> NewLimit:
        """The refusals stayed: they are the endpoint's background. Back up to ``level`` and
        learn the background from this round (the round that started the trial was picked for
        its refusals, a biased sample). Stay a few rounds, taking such refusals as background
        for longer each time a trial says so again."""
        self.shares.learn(done.share, done.answered)
        self.good, self.hold, self.probe_by = level, _HOLD_ROUNDS, math.inf
        self.calm = min(2 * self.calm or _HOLD_ROUNDS, _MAX_PROBE_WAIT)
        self.calm_left = self.calm
        return NewLimit(level)

    def _refused_in_a_row(self, limit: int, now: float) -> NewLimit | None:
        """A streak of refusals: over a limit, no doubt. Just past the last good level: back to
        it; else half the calls at once."""
        if self.good is not None and limit > self.good:
            return self._step_back(limit, now)
        self._refused_at(limit, now)
        self.good = None
        return self._cut(limit // 2, limit)

    def _refused_more_than_usual(self, done: Round, limit: int, now: float) -> NewLimit | None:
        """More refusals than the background and chance explain."""
        if self.good is not None and limit > self.good:
            return self._step_back(limit, now)  # refused just past the last good level
        if not self.nudged and self._ceiling_within(limit, max(2, limit // 8)):
            return self._an_eighth_lower(limit, now)
        return self._towards_a_trial(done, limit)

    def _an_eighth_lower(self, limit: int, now: float) -> NewLimit | None:
        """Refused at a good level just below one refused for concurrency: that limit. An
        eighth lower, once; refused again there, a trial tells."""
        self.nudged = True
        self._refused_at(limit, now)
        self.good = None
        return self._cut(limit - max(1, limit // 8), limit)

    def _towards_a_trial(self, done: Round, limit: int) -> NewLimit | None:
        """Refused at a level that was clean: the endpoint's doing or a new limit? Half the
        calls for as long will tell, once such rounds at this level add up to
        ``_TRIAL_REFUSALS``: with fewer, half the calls at the endpoint's own share would as
        likely show none. Until then the level holds."""
        before = self.tally if self.tally.level == limit else Tally()
        tally = Tally(limit, before.calls + done.answered, before.refused + done.refused)
        self.tally = tally
        self.step = 1
        if tally.refused < _TRIAL_REFUSALS:
            return None
        cut = self._cut(limit // 2, limit)
        if cut is not None:
            self.trial = Trial(limit, self.rate, tally.refused / tally.calls, tally.calls)
            self.tally = Tally()
            self.nudged = False
        return cut

    def _no_ground_to_grow(self, limit: int) -> None:
        """More refusals than usual, though too few to mean something alone.

        A shard a few calls over a limit sees few refusals: refused calls wait holding their
        slots, and a server that queues, or a client short of CPU, refuses now and then. Such a
        level is not taken for good, and the shard does not grow past it."""
        self.step = 1
        self.clean = CleanRun(limit, 0)

    def _clean_round(self, limit: int, now: float) -> NewLimit | None:
        """A clean round. Past a refusal (a refused level is remembered), a level is good after
        ``_CONFIRM`` clean rounds in a row: one clean round a few calls over a limit proves
        little. Once a probe past the refused level passed (``step`` > 1), the limit moved
        up: one clean round makes the next level good. A good level grows, unless a hold
        keeps it."""
        rounds = self.clean.rounds + 1 if self.clean.level == limit else 1
        self.clean = CleanRun(limit, rounds)
        if self.ceiling is not None and rounds < (_CONFIRM if self.step == 1 else 1):
            return None
        self.good = limit
        if self.hold and now < self.probe_by:
            self.hold -= 1
            return None
        self.hold = 0
        if self.ceiling is None:
            return NewLimit(limit + max(1, limit // 4))  # a quarter more per round
        if limit >= self.ceiling.level:
            return self._probe_past_the_refused_level(limit, self.ceiling)
        return self._half_way_to_the_refused_level(limit, self.ceiling)

    def _probe_past_the_refused_level(self, limit: int, ceiling: Ceiling) -> NewLimit:
        """A level once refused now passes: the limit moved up, or its refusals were a queue
        overflowing now and then. One more, then twice as many per clean round (a quarter more
        at once would send a burst of refusals), until refused again or it is forgotten."""
        self.ceiling = Ceiling(limit + 1, ceiling.at)
        probe = NewLimit(limit + self.step)
        self.step *= 2
        return probe

    @staticmethod
    def _half_way_to_the_refused_level(limit: int, ceiling: Ceiling) -> NewLimit:
        """Below a level refused for concurrency: a quarter more, half way to it at most (the
        range where the endpoint starts refusing halves at each step), then it."""
        halfway = (limit + ceiling.level) // 2
        return NewLimit(max(limit + 1, min(limit + limit // 4, halfway)))

    def _refused_at(self, level: int, now: float) -> None:
        """``level`` was refused for concurrency: growth stops below it for a while. Any hold
        ends: a level held because its refusals were the endpoint's own says nothing of a
        lower one."""
        self.ceiling = Ceiling(level, now)
        self.step = 1
        self.hold, self.probe_by = 0, math.inf

    def _ceiling_within(self, limit: int, calls: int) -> bool:
        return self.ceiling is not None and self.ceiling.level <= limit + calls

    def _step_back(self, limit: int, now: float) -> NewLimit | None:
        """Back to the last good level, and probe past it again later (each failed probe of
        this limit waits twice as many rounds, 2 s at most)."""
        assert self.good is not None
        good = self.good
        self._refused_at(limit, now)
        self.hold = self.probe_wait
        self.probe_by = now + _MAX_PROBE_SECONDS
        self.probe_wait = min(2 * self.probe_wait, _MAX_PROBE_WAIT)
        return self._cut(good, limit)

    def _cut(self, level: int, limit: int) -> NewLimit | None:
        """Lower ``limit`` to ``level``, not below the floor; None when that lowers nothing."""
        lowered = max(self.floor, level)
        return None if lowered >= limit else NewLimit(lowered, cut=True)


def spread(share: float, calls: int) -> float:
    """How far chance moves the share refused in a round of ``calls`` (one standard deviation;
    a share under 1 % counts as 1 %, so that a round with none still allows a few)."""
    return math.sqrt(max(share, 0.01) * (1 - share) / calls)
