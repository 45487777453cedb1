"""Pacing by the limits an endpoint states: a request starts only when its cost fits the budget.

An endpoint that meters a key (OpenAI, Anthropic, a proxy) states with every answer what is left
of each budget of the key: requests and tokens per window, what remains, when it is full again.
The endpoint resources read those headers (``resources/rate_limits.py``) and hand them here as
:class:`Limit` values; this module imports nothing else of the package, so the resources may
import it.

The rules of a :class:`Pacer` (one per key and process):

- **A request waits until its cost fits.** Its cost is one request and its estimated tokens
  (input and output). It starts when every known budget holds it, in the order requests came.
  A request larger than a whole budget waits until that budget is full. A waiter sleeps until
  its request starts or its wait changes (``Ticket.wake``): a request started on behalf of a
  sleeping one is sent at once, not when that one's own estimate ends.
- **What is left, as stated.** An answer sets a budget's level to the remaining it states, less
  what this process started after the answered request (the endpoint had not counted those yet).
  The endpoint stated it during the request's round trip: once the share is measured, half of
  that trip counts as refilled. Until the next answer, the level refills at the stated rate, up
  to the limit. That rate is
  what is missing, over the time to the reset. A window that refills all at once
  (``steady=False``) is full again at its reset.
- **Shards share a key through the headers.** Every shard on the key sees what all of them
  drew: the remaining falls faster than its own draw. A pacer measures its share of the key's
  draw over the last seconds. At first that is since it began, the key taken as full then. It
  takes that share of what is left and of the refill, less a margin. So shards that run at
  once take about the stated rate between them, with no coordination service.
  Of what is left it takes less the emptier the key is: its share times the part of the budget
  left. Shares measured while shards start apart add up past 1 for a while; the key then keeps
  some of what it holds. Alone, the share is about 1. A token estimate that falls short of the
  endpoint's count lowers it to match.
- **Shards of one machine take equal shares** (:meth:`Pacer.pool`). Measured shares that add
  up to the key are measured back as they are, so shards that start unequal would stay so and
  end far apart. The processes calling a key count each other and publish what they measured
  (``resources/peers.py``). Each takes the mean, at most one over their count. The mean keeps
  the sum of the shares, so what other machines draw stays out of it.
- **A slow start** (:class:`Ramp`). Until answers say what the key has left and what other
  shards draw, a pacer keeps ``FIRST_CALLS`` requests in flight, one more per answer. One answer
  is not enough: it states the key as it was when its request arrived, before the requests of
  the shards that started at the same moment. The ramp ends once the share is measured, once
  ``RAMP_CALLS`` may fly, or at an answer that states no budget when the user stated none.
  A request that ends without an answer (a dropped connection) stops counting after
  ``FIRST_HOLD_SECONDS``.
- **No statement, no pacing**, unless the user stated limits (:meth:`Pacer.assume`): a budget
  nothing states is not paced, and the shard's adaptive concurrency (``throttle.py``) answers
  refusals as before.
- A request that would wait longer than ``patience`` seconds (a daily quota spent) starts
  anyway: the endpoint refuses it, and the shard's rate-limit handling takes over.

Each shard keeps a :class:`Record` of what its requests drew and waited; its gate makes it the
record of the calls it admits (:func:`attach`), so a request knows its shard without arguments.
"""

from __future__ import annotations

import contextvars
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from checkpoint_assets.engine.calls.shares import SHARE_PAIRS, Bucket, Started
from checkpoint_assets.engine.calls.shares import Limit as Limit  # the resources' name for it

#: The budgets a key may have: requests, tokens (input and output together), and input and
#: output tokens counted apart (Anthropic).
KINDS = ("requests", "tokens", "input_tokens", "output_tokens")
PATIENCE_SECONDS = 120.0  # the longest a request waits for budget before it is sent anyway
_ASSUMED_BURST = 0.9  # seconds' worth of an assumed budget that may go at once
FIRST_CALLS = 2  # requests in flight before the first answer
RAMP_CALLS = 64  # the slow start ends when this many may be in flight
FIRST_HOLD_SECONDS = 10.0  # the longest a request counts in flight without an answer
_RAMP_POLL = 0.02  # seconds a request held by the slow start waits before it looks again

Cost = Mapping[str, float]


def cost(input_tokens: float, output_tokens: float) -> dict[str, float]:
    """The cost of one request with these estimated tokens, by budget."""
    return {
        "requests": 1.0,
        "tokens": input_tokens + output_tokens,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
    }


class Ticket:
    """One request, from when it asks to start until its answer is reported.

    ``wake`` is set by whoever waits for the ticket. It is called, outside the pacer's lock,
    when the ticket starts while its waiter sleeps, or when its wait changed. The wait changes
    when the ticket reaches the head of the queue, or when an answer restates the budgets.
    """

    __slots__ = ("admitted", "at", "cost", "drawn", "record", "seq", "wake")

    def __init__(self, cost: Cost, record: Record | None) -> None:
        self.cost = cost
        self.record = record
        self.admitted = False
        self.seq = 0  # the order requests started in (1, 2, ...)
        self.at = 0.0  # when it started (the pacer's clock)
        self.drawn: dict[str, float] = {}  # the pacer's own draw by budget, this request's too
        self.wake: Callable[[], None] | None = None


class Pacer:
    """The budgets of one key in this process; requests wait in :meth:`wait` until they fit.

    Thread-safe: the threads of a plain function and the tasks of an event loop share it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, Bucket] = {}
        self._queue: deque[Ticket] = deque()
        self._seq = 0
        self._own = dict.fromkeys(KINDS, 0.0)  # cost of every request started
        self._refused = dict.fromkeys(KINDS, 0.0)  # of which refused
        self._ramp = Ramp()

    def assume(self, per_minute: Mapping[str, float], share: float = 1.0) -> None:
        """Budgets the user knows (per minute, by kind) for an endpoint that states none, of
        which this process takes ``share`` (:meth:`reshare` changes it).

        They start empty and fill at the share of the rate. At most 0.9 of a second's worth of
        the share goes at once: nothing says how much more an unknown server holds, and the
        rest covers the time a request takes to reach it. A refused request's cost stays drawn
        from them. An answer that states a budget replaces them."""
        now = self.clock()
        with self._lock:
            if per_minute:
                self._ramp.on = False  # the user's budgets pace from the first request
            for kind, limit in per_minute.items():
                if kind not in self._buckets:
                    per_second = limit / 60
                    bucket = Bucket(Limit(per_second, 0.0, 1.0), now)
                    bucket.rate = bucket.key_rate = per_second
                    bucket.cap = _ASSUMED_BURST * per_second
                    bucket.share = share
                    self._buckets[kind] = bucket

    def reshare(self, share: float) -> None:
        """This process now takes ``share`` of the assumed budgets (more or fewer processes
        call the key). What it holds shrinks with a smaller share; what it owes (a hold, a
        refusal) takes as long to repay at the new share."""
        now = self.clock()
        with self._lock:
            for bucket in self._buckets.values():
                if not bucket.stated and share != bucket.share:
                    bucket.refill(now)
                    if bucket.level < 0 or share < bucket.share:
                        bucket.level *= share / bucket.share
                    bucket.share = share
            woken, _ = self._drain(now)
            if self._queue and self._queue[0] not in woken:
                woken.append(self._queue[0])
        _wake(woken)

    def measured(self) -> dict[str, float]:
        """The shares of the key's draw this pacer has measured, by stated budget."""
        with self._lock:
            return {
                kind: bucket.measured
                for kind, bucket in self._buckets.items()
                if bucket.stated and bucket.pairs >= SHARE_PAIRS
            }

    def pool(self, count: int, measured: Mapping[str, list[float]]) -> None:
        """``count`` processes of this machine call the key; ``measured``: the shares they
        measured, by budget (this one's too). Each stated budget takes their mean, at most
        ``1 / count``."""
        with self._lock:
            for kind, bucket in self._buckets.items():
                if bucket.stated:
                    shares = measured.get(kind)
                    bucket.pool(1 / count, sum(shares) / len(shares) if shares else None)

    def hold(self, seconds: float) -> None:
        """Start nothing from the assumed budgets for ``seconds`` from now (this process joins
        others on the key, which have yet to count it)."""
        now = self.clock()
        with self._lock:
            for bucket in self._buckets.values():
                if not bucket.stated:
                    bucket.refill(now)
                    bucket.level = min(bucket.level, -bucket.share * bucket.rate * seconds)

    def ask(self, cost: Cost, record: Record | None = None) -> Ticket:
        """A request with this ``cost`` asks to start: it queues behind the others."""
        ticket = Ticket(cost, record)
        with self._lock:
            self._queue.append(ticket)
        return ticket

    def wait(self, ticket: Ticket) -> float:
        """Seconds ``ticket`` has yet to wait; 0 once it may start (it then counts as drawn).

        The requests ahead of it that fit start on their behalf: their waiters are woken."""
        now = self.clock()
        with self._lock:
            woken, held = self._drain(now)
            if ticket.admitted or ticket not in self._queue:
                wait = 0.0
            elif held > 0:
                wait = held
            else:
                need: dict[str, float] = {}
                for queued in self._queue:  # it waits for those ahead of it too
                    for kind, value in queued.cost.items():
                        need[kind] = need.get(kind, 0.0) + value
                    if queued is ticket:
                        break
                wait = self._fits(need, now)
        _wake(t for t in woken if t is not ticket)
        return wait

    def force(self, ticket: Ticket) -> None:
        """Start ``ticket`` now, whatever the budgets say (it waited ``PATIENCE_SECONDS``)."""
        self._leave(ticket, start=True)

    def cancel(self, ticket: Ticket) -> None:
        """``ticket`` will not be sent (its request was cancelled while it waited)."""
        self._leave(ticket, start=False)

    def _leave(self, ticket: Ticket, start: bool) -> None:
        woken: list[Ticket] = []
        with self._lock:
            if not ticket.admitted and ticket in self._queue:
                head = self._queue[0] is ticket
                self._queue.remove(ticket)
                if start:
                    self._start(ticket, self.clock())
                if head and self._queue:
                    woken.append(self._queue[0])  # the next one's wait is its own now
        _wake(woken)

    def _drain(self, now: float) -> tuple[list[Ticket], float]:
        """Start the requests at the head of the queue that fit now. Returns those to wake (the
        ones started, and the new head, whose wait is its own now) and how long the slow start
        holds the next one (0: it does not)."""
        for bucket in self._buckets.values():
            bucket.refill(now)
        head = self._queue[0] if self._queue else None
        woken: list[Ticket] = []
        held = 0.0
        while self._queue and self._fits(self._queue[0].cost, now) == 0:
            if (held := self._ramp.wait(now)) > 0:
                break
            ticket = self._queue.popleft()
            self._start(ticket, now)
            woken.append(ticket)
        if self._queue and self._queue[0] is not head:
            woken.append(self._queue[0])
        return woken, held

    def report(self, ticket: Ticket, stated: Mapping[str, Limit], refused: bool) -> None:
        """The answer to ``ticket`` stated these budgets (by kind); ``refused``: with a 429."""
        now = self.clock()
        with self._lock:
            if refused and ticket.admitted:
                for kind, value in ticket.cost.items():
                    self._refused[kind] = self._refused.get(kind, 0.0) + value
            for kind, bucket in self._buckets.items():
                # Refused and not stated: nothing was drawn from a stated budget. From an
                # assumed one it stays drawn: the key is spent, and the shard slows by as much.
                if refused and kind not in stated and bucket.stated:
                    bucket.level += ticket.cost.get(kind, 0.0)
            for kind, limit in stated.items():
                if limit.limit <= 0:
                    continue
                known = self._buckets.get(kind)
                if known is None or not known.stated:  # a stated budget replaces an assumed one
                    known = self._buckets[kind] = Bucket(limit, now)
                started = Started(ticket.seq, ticket.at, ticket.drawn.get(kind, 0.0))
                known.report(limit, started, self._own[kind], self._refused[kind], now)
            budgets = {k: (b.key_rate, b.cap) for k, b in self._buckets.items()}
            measured = any(b.pairs >= SHARE_PAIRS for b in self._buckets.values())
            self._ramp.answered(ticket, refused, over=measured or not self._buckets)
            # The budgets changed: what fits now starts, and the head's wait is new.
            woken, _ = self._drain(now)
            if self._queue and self._queue[0] not in woken:
                woken.append(self._queue[0])
        _wake(woken)
        if ticket.record is not None:
            ticket.record.answered(now, budgets)

    def _fits(self, need: Cost, now: float) -> float:
        """Seconds until ``need`` fits every budget (0: now)."""
        return max((b.wait(need.get(k, 0.0), now) for k, b in self._buckets.items()), default=0.0)

    def share(self, kind: str) -> float | None:
        """This pacer's measured share of the key's draw of a budget (None: not stated)."""
        with self._lock:
            bucket = self._buckets.get(kind)
            return None if bucket is None else bucket.share

    def _start(self, ticket: Ticket, now: float) -> None:
        self._seq += 1
        ticket.admitted, ticket.seq, ticket.at = True, self._seq, now
        for kind, value in ticket.cost.items():
            self._own[kind] = self._own.get(kind, 0.0) + value
            bucket = self._buckets.get(kind)
            if bucket is not None:
                bucket.level -= value
        ticket.drawn = dict(self._own)
        self._ramp.started(ticket)
        if ticket.record is not None:
            ticket.record.drew(ticket.cost, now)


class Ramp:
    """The slow start of a pacer: how many requests may be in flight before the share of the
    key is measured (see the module's rules)."""

    def __init__(self) -> None:
        self.on = True
        self.window = FIRST_CALLS
        self._flying: dict[int, float] = {}  # started and not answered: seq -> when

    def wait(self, now: float) -> float:
        """Seconds before another request may start (0: now)."""
        if not self.on:
            return 0.0
        for seq, at in list(self._flying.items()):
            if now - at >= FIRST_HOLD_SECONDS:  # it ended without an answer
                del self._flying[seq]
        if len(self._flying) < self.window:
            return 0.0
        oldest = min(self._flying.values())
        return min(_RAMP_POLL, oldest + FIRST_HOLD_SECONDS - now)

    def started(self, ticket: Ticket) -> None:
        if self.on:
            self._flying[ticket.seq] = ticket.at

    def answered(self, ticket: Ticket, refused: bool, over: bool) -> None:
        """``ticket`` was answered; ``over``: the pacer no longer needs the ramp."""
        self._flying.pop(ticket.seq, None)
        if not refused:
            self.window += 1
        if over or self.window >= RAMP_CALLS:
            self.on = False
            self._flying.clear()


class Record:
    """What one shard's requests drew from the budgets and how long they waited for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.wait_seconds = 0.0  # time during which at least one request waited for budget
        self._held_until = -math.inf
        self.drawn = dict.fromkeys(KINDS, 0.0)
        self._budgets: dict[str, tuple[float, float]] = {}  # the key's: per second, when full
        self._first: float | None = None
        self._last = 0.0

    def waited(self, began: float, ended: float) -> None:
        """A request waited for budget from ``began`` to ``ended`` (the pacer's clock)."""
        with self._lock:
            if ended > self._held_until:
                self.wait_seconds += ended - max(began, self._held_until)
                self._held_until = ended

    def drew(self, cost: Cost, now: float) -> None:
        with self._lock:
            for kind, value in cost.items():
                self.drawn[kind] = self.drawn.get(kind, 0.0) + value
            if self._first is None:
                self._first = now
            self._last = max(self._last, now)

    def answered(self, now: float, budgets: Mapping[str, tuple[float, float]]) -> None:
        with self._lock:
            self._budgets.update({k: b for k, b in budgets.items() if b[0] > 0})
            self._last = max(self._last, now)

    @property
    def budget_used(self) -> float | None:
        """The share of the key's budget this shard drew while it called the endpoint (a full
        budget, then its refill over that time), of the budget it came closest to spending.
        None when no budget was stated or assumed."""
        with self._lock:
            if self._first is None or self._last <= self._first or not self._budgets:
                return None
            seconds = self._last - self._first
            return max(
                self.drawn.get(k, 0.0) / (rate * seconds + full)
                for k, (rate, full) in self._budgets.items()
            )


def _wake(tickets: Iterable[Ticket]) -> None:
    for ticket in tickets:
        if ticket.wake is not None:
            ticket.wake()


_RECORD: contextvars.ContextVar[Record | None] = contextvars.ContextVar(
    "checkpoint_assets_pacing_record", default=None
)


def attach(record: Record) -> None:
    """Make ``record`` the record of the requests this thread or task sends from now on."""
    if _RECORD.get() is not record:
        _RECORD.set(record)


def current() -> Record | None:
    """The record of the shard whose call is running here, if any."""
    return _RECORD.get()
