"""Pacing by stated limits (engine/calls/pacing.py): requests wait until their cost fits what the
key has left, and pacers that share a key take about its rate between them.

The clock is injected: nothing here sleeps. The shared-key tests run pacers against a model of
an endpoint that meters a key the way OpenAI does (a token bucket refilled steadily, its state
stated with every answer, a refusal for what does not fit).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import pytest

from checkpoint_assets.engine.calls import pacing
from checkpoint_assets.engine.calls.pacing import Limit, Pacer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tokens(remaining: float, limit: float = 600.0, reset: float | None = None) -> dict:
    """A statement of a tokens budget refilled at ``limit`` per second."""
    if reset is None:
        reset = (limit - remaining) / limit
    return {"tokens": Limit(limit, remaining, reset)}


def started(pacer: Pacer, cost: float) -> pacing.Ticket:
    ticket = pacer.ask(pacing.cost(cost, 0))
    assert pacer.wait(ticket) == 0
    return ticket


def test_before_the_first_answer_only_a_few_requests_start() -> None:
    pacer = Pacer(Clock())
    first = [started(pacer, 100) for _ in range(pacing.FIRST_CALLS)]
    held = [pacer.ask(pacing.cost(100, 0)) for _ in range(30)]

    assert all(pacer.wait(t) > 0 for t in held)
    pacer.report(first[0], {}, refused=False)  # an answer that states no budget
    assert all(pacer.wait(t) == 0 for t in held)


def test_without_a_statement_requests_start_at_once_after_the_first_answer() -> None:
    pacer = Pacer(Clock())
    pacer.report(started(pacer, 1), {}, refused=False)
    for _ in range(100):
        started(pacer, 1_000_000)


def test_requests_that_end_without_an_answer_stop_holding_the_others() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    for _ in range(pacing.FIRST_CALLS):
        started(pacer, 1)  # their connections drop: no answer is ever reported
    held = pacer.ask(pacing.cost(1, 0))
    assert 0 < pacer.wait(held) <= pacing.FIRST_HOLD_SECONDS

    clock.now = pacing.FIRST_HOLD_SECONDS
    assert pacer.wait(held) == 0


def spent(pacer: Pacer) -> float:
    """Draw a whole budget of 600 tokens (600 a second), as the answer states; the share of the
    key the pacer then takes (all of it, less its margin)."""
    pacer.report(started(pacer, 600), tokens(remaining=0), refused=False)
    share = pacer.share("tokens")
    assert share is not None and 0.9 <= share <= 1
    return share


def test_a_request_waits_while_the_stated_budget_is_spent_then_starts() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    share = spent(pacer)

    held = pacer.ask(pacing.cost(40, 20))
    assert pacer.wait(held) == pytest.approx(0.1 / share)
    clock.now = 0.05
    assert pacer.wait(held) == pytest.approx(0.1 / share - 0.05)
    clock.now = 0.1 / share
    assert pacer.wait(held) == 0


def test_requests_started_after_the_answered_one_count_against_what_is_left() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    pacer.report(started(pacer, 0), {}, refused=False)  # the first answer lifts the hold
    answered = started(pacer, 200)
    later = [started(pacer, 100) for _ in range(3)]  # in flight, not counted by the endpoint yet
    pacer.report(answered, tokens(remaining=1_200, limit=1_500), refused=False)
    share = pacer.share("tokens")
    assert share is not None

    left = share * 1_200 * (1_200 / 1_500) - 300
    assert pacer.wait(pacer.ask(pacing.cost(left, 0))) == 0
    held = pacer.ask(pacing.cost(100, 0))
    assert pacer.wait(held) == pytest.approx(100 / (1_500 * share))
    assert len(later) == 3


def test_the_key_refilled_while_a_late_answer_came_back() -> None:
    # The endpoint stated the key somewhere between the request's start and its answer: half
    # that time counts as refilled. Left out, answers slower than the key's window would keep
    # the shards drawing less than its rate.
    clock = Clock()
    pacer = Pacer(clock)
    for remaining in (540, 480, 420, 360, 300):  # answers in a row: the share is measured
        pacer.report(started(pacer, 60), tokens(remaining), refused=False)
    answered = started(pacer, 60)
    clock.now = 2.0  # the answer comes 2 s later, stating the key spent (600 a second)
    pacer.report(answered, tokens(remaining=0), refused=False)
    share = pacer.share("tokens")
    assert share is not None

    assert pacer.wait(pacer.ask(pacing.cost(share * 600 - 1, 0))) == 0  # 1 s of refill
    assert pacer.wait(pacer.ask(pacing.cost(2, 0))) > 0


def test_the_emptier_the_key_the_less_of_what_is_left_is_taken_at_once() -> None:
    # Shards that start apart measure shares adding up past 1 for a while: each taking its
    # share of all that is left, together they would take more than is left, and be refused.
    clock = Clock()
    pacer = Pacer(clock)
    pacer.report(started(pacer, 0), {}, refused=False)
    answered = started(pacer, 300)
    pacer.report(answered, tokens(remaining=300), refused=False)  # half the key is left
    share = pacer.share("tokens")
    assert share is not None and share > 0.5

    assert pacer.wait(pacer.ask(pacing.cost(share * 300 / 2 - 1, 0))) == 0
    assert pacer.wait(pacer.ask(pacing.cost(2, 0))) > 0


def test_requests_start_in_the_order_they_asked() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    share = spent(pacer)
    first, second = pacer.ask(pacing.cost(60, 0)), pacer.ask(pacing.cost(60, 0))

    assert pacer.wait(second) == pytest.approx(0.2 / share)  # behind the first
    clock.now = 0.1 / share
    assert pacer.wait(second) == pytest.approx(0.1 / share)  # the first started, on its behalf
    assert first.admitted and not second.admitted


def test_a_request_started_on_behalf_of_a_sleeping_one_wakes_it() -> None:
    # The second request's waiter sleeps for both requests' wait; the first one's waiter, back
    # when its own shorter wait ends, starts both. The second must go then, not later: counted
    # as drawn and never sent, it held every shard's budget while the key stayed full.
    clock = Clock()
    pacer = Pacer(clock)
    share = spent(pacer)
    first, second = pacer.ask(pacing.cost(60, 0)), pacer.ask(pacing.cost(60, 0))
    woken: list[pacing.Ticket] = []
    second.wake = lambda: woken.append(second)
    assert pacer.wait(second) == pytest.approx(0.2 / share)

    clock.now = 0.2 / share
    assert pacer.wait(first) == 0

    assert second.admitted and woken == [second]


def test_an_answer_that_restates_the_budget_starts_the_requests_that_fit_and_wakes_them() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    share = spent(pacer)
    answered = pacer.ask(pacing.cost(0, 0))
    held = [pacer.ask(pacing.cost(60, 0)) for _ in range(3)]
    woken: list[pacing.Ticket] = []
    for ticket in held:
        ticket.wake = lambda ticket=ticket: woken.append(ticket)  # type: ignore[misc]
    assert pacer.wait(held[-1]) == pytest.approx(0.3 / share)
    assert answered.admitted  # it cost nothing: it went first, and the next one's wait is its own
    woken.clear()

    pacer.report(answered, tokens(remaining=600), refused=False)  # the key is full again

    assert all(t.admitted for t in held) and woken == held


def test_the_next_request_is_woken_when_the_one_ahead_leaves_the_queue() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    share = spent(pacer)
    first, second = pacer.ask(pacing.cost(60, 0)), pacer.ask(pacing.cost(60, 0))
    woken: list[pacing.Ticket] = []
    second.wake = lambda: woken.append(second)
    assert pacer.wait(second) == pytest.approx(0.2 / share)

    pacer.cancel(first)  # its request was cancelled while it waited

    assert woken == [second] and not first.admitted
    assert pacer.wait(second) == pytest.approx(0.1 / share)


def test_a_request_larger_than_the_budget_starts_when_the_budget_is_full() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    share = spent(pacer)
    huge = pacer.ask(pacing.cost(5_000, 0))

    assert pacer.wait(huge) == pytest.approx(1.0 / share)
    clock.now = 1.0 / share
    assert pacer.wait(huge) == 0


def test_a_pacer_that_drew_a_quarter_of_what_the_key_lost_takes_a_quarter() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    pacer.report(started(pacer, 150), tokens(remaining=0), refused=False)  # others drew 450
    share = pacer.share("tokens")

    assert share is not None and 0.2 <= share <= 0.25
    assert pacer.wait(pacer.ask(pacing.cost(60, 0))) == pytest.approx(0.1 / share)


def test_a_refused_request_stays_drawn_from_assumed_limits() -> None:
    # Shards that take all of a key's assumed rate between them leave it no slack: a refusal
    # says the key is spent. Given back, the cost would be sent again at once, and refused
    # again.
    clock = Clock()
    pacer = Pacer(clock)
    pacer.assume({"requests": 120})  # two per second, from none
    clock.now = 0.5
    ticket = started(pacer, 0)
    held = pacer.ask(pacing.cost(0, 0))
    assert pacer.wait(held) == pytest.approx(0.5)
    pacer.report(ticket, {}, refused=True)  # a 429 without headers

    assert pacer.wait(held) == pytest.approx(0.5)


def test_a_refusal_without_headers_gives_back_what_a_stated_budget_counted() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    share = spent(pacer)
    clock.now = 0.1 / share
    ticket = started(pacer, 60)
    held = pacer.ask(pacing.cost(60, 0))
    assert pacer.wait(held) > 0
    pacer.report(ticket, {}, refused=True)  # a 429 that states nothing: it drew nothing

    assert pacer.wait(held) == 0


def test_assumed_limits_are_shared_by_the_shards_at_once() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    pacer.assume({"tokens": 6_000}, share=1 / 4)  # 100 a second for the key, 25 for this one
    first = pacer.ask(pacing.cost(22.5, 0))  # a quarter of 0.9 s worth: the most it holds
    assert pacer.wait(first) == pytest.approx(0.9)  # from none
    clock.now = 10.0
    assert pacer.wait(first) == 0

    held = pacer.ask(pacing.cost(20, 0))
    assert pacer.wait(held) == pytest.approx(0.8)


def test_an_assumed_share_follows_the_shards_at_once() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    pacer.assume({"tokens": 6_000}, share=1 / 4)
    clock.now = 10.0  # it holds 22.5 (a quarter of 0.9 s worth)
    pacer.reshare(1 / 2)  # two of the four shards finished
    held = pacer.ask(pacing.cost(40, 0))
    assert pacer.wait(held) == pytest.approx(0.35)  # 50 a second for the 17.5 it lacks

    pacer.reshare(1 / 8)  # six more started: it holds an eighth of what it held
    # More than an eighth of 0.9 s worth (11.25): it goes when that much is held.
    assert pacer.wait(held) == pytest.approx((11.25 - 22.5 / 4) / 12.5)


def test_a_stated_budget_replaces_an_assumed_one() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    pacer.assume({"tokens": 60})
    clock.now = 1.0
    pacer.report(started(pacer, 1), tokens(remaining=6_000, limit=6_000), refused=False)

    started(pacer, 5_000)


def test_a_fixed_window_is_full_again_at_its_reset() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    window = {"requests": Limit(10, 0, 3.0, steady=False)}
    pacer.report(started(pacer, 0), window, refused=False)
    held = pacer.ask(pacing.cost(0, 0))

    assert pacer.wait(held) == pytest.approx(3.0)
    clock.now = 3.0
    assert pacer.wait(held) == 0


def test_the_record_holds_the_waits_the_draw_and_the_share_of_the_budget() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    record = pacing.Record()
    first = pacer.ask(pacing.cost(300, 0), record)
    assert pacer.wait(first) == 0
    pacer.report(first, tokens(remaining=300, limit=600), refused=False)
    record.waited(0.0, 0.5)
    record.waited(0.25, 0.75)  # overlapping waits count once
    clock.now = 1.0
    second = pacer.ask(pacing.cost(300, 0), record)
    assert pacer.wait(second) == 0
    pacer.report(second, tokens(remaining=0, limit=600), refused=False)

    assert record.wait_seconds == pytest.approx(0.75)
    assert record.drawn["tokens"] == 600
    # 600 tokens of a full budget (600) and 1 s of its refill (600 a second).
    assert record.budget_used == pytest.approx(0.5)


# -- pacers sharing one key ------------------------------------------------------------------
@dataclass
class Endpoint:
    """A key's tokens budget, refilled steadily, stated with every answer."""

    limit: float
    per_second: float
    level: float = 0.0
    at: float = 0.0
    drawn: float = 0.0
    refused: int = 0
    answered: int = 0
    settled_at: float = 2.0  # refusals after this count apart: the shares are measured by then
    refused_settled: int = 0
    drawn_settled: float = 0.0
    by_shard: dict[int, float] = field(default_factory=dict)  # tokens answered, by shard

    def __post_init__(self) -> None:
        self.level = self.limit

    def admit(self, cost: float, now: float) -> tuple[bool, dict]:
        self.level = min(self.limit, self.level + self.per_second * (now - self.at))
        self.at = now
        fits = self.level >= cost
        if fits:
            self.level -= cost
            self.drawn += cost
            self.drawn_settled += cost if now >= self.settled_at else 0.0
            self.answered += 1
        else:
            self.refused += 1
            self.refused_settled += now >= self.settled_at
        reset = (self.limit - self.level) / self.per_second
        return fits, {"tokens": Limit(self.limit, int(self.level), reset)}


@dataclass
class Shard:
    pacer: Pacer
    in_flight: int = 0
    waiting: list[pacing.Ticket] = field(default_factory=list)


def run_shards(
    shards: int,
    seconds: float,
    concurrency: int = 8,
    others_end: float = math.inf,
    settled_at: float = 2.0,
    apart: float = 0.0,
    pooled: bool = True,
) -> Endpoint:
    """``shards`` pacers on one key, each keeping ``concurrency`` requests of 50 tokens going,
    50 ms per answer; shard i starts at ``i * apart``; all but the first stop asking at
    ``others_end``. With ``pooled``, every 0.5 s each takes the mean share they measured, as
    the processes of one machine do (``resources/peers.py``)."""
    clock = Clock()
    endpoint = Endpoint(limit=3_000, per_second=500, settled_at=settled_at)  # 10 a second fit
    clients = [Shard(Pacer(clock)) for _ in range(shards)]
    answers: list[tuple[float, int, int, pacing.Ticket, bool, dict]] = []  # a heap
    step, n, next_pool = 0.002, 0, 0.0
    while clock.now < seconds:
        calling = [
            c
            for i, c in enumerate(clients)
            if i * apart <= clock.now < (others_end if i else math.inf)
        ]
        if pooled and clock.now >= next_pool:
            measured = [c.pacer.measured().get("tokens") for c in calling]
            shares = {"tokens": [m for m in measured if m is not None]}
            for shard in calling:
                shard.pacer.pool(len(calling), shares)
            next_pool += 0.5
        for i, shard in enumerate(clients):
            if clock.now < i * apart:
                continue
            if i > 0 and clock.now >= others_end:
                shard.waiting.clear()
            while (i == 0 or clock.now < others_end) and (
                shard.in_flight + len(shard.waiting) < concurrency
            ):
                shard.waiting.append(shard.pacer.ask(pacing.cost(50, 0)))
            for ticket in list(shard.waiting):
                if shard.pacer.wait(ticket) == 0:
                    shard.waiting.remove(ticket)
                    shard.in_flight += 1
                    fits, stated = endpoint.admit(50, clock.now)
                    n += 1
                    heapq.heappush(answers, (clock.now + 0.05, n, i, ticket, fits, stated))
        while answers and answers[0][0] <= clock.now:
            _, _, i, ticket, fits, stated = heapq.heappop(answers)
            clients[i].pacer.report(ticket, stated, refused=not fits)
            clients[i].in_flight -= 1
            endpoint.by_shard[i] = endpoint.by_shard.get(i, 0.0) + (50 if fits else 0)
        clock.now += step
    return endpoint


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_pacers_on_one_key_use_its_rate_between_them_with_few_refusals(shards: int) -> None:
    endpoint = run_shards(shards, seconds=12.0)

    # The budget it starts with, then 500 tokens a second.
    used = (endpoint.drawn - endpoint.limit) / (500 * 12.0)
    assert used >= 0.9, used
    # Before any answer, each pacer sends blind; once their shares are measured, few refusals.
    assert endpoint.refused_settled <= max(2, 0.02 * endpoint.answered), endpoint


def test_a_shard_left_alone_on_the_key_takes_all_of_it() -> None:
    # Four shards share the key for 6 s, then three end: the last one's share was about a
    # quarter, and the key left full tells it the rest is unused.
    endpoint = run_shards(4, seconds=20.0, others_end=6.0, settled_at=8.0)

    assert endpoint.drawn_settled >= 0.9 * 500 * (20.0 - 8.0), endpoint


@pytest.mark.parametrize("pooled", [True, False])
def test_shards_that_start_apart_draw_alike_when_they_pool_their_shares(pooled: bool) -> None:
    # Four shards start 1 s apart; the first takes most of the key before the others come.
    # Measured shares are measured back as they are taken: alone, they would stay apart.
    early = run_shards(4, seconds=6.0, apart=1.0, pooled=pooled)
    endpoint = run_shards(4, seconds=16.0, apart=1.0, pooled=pooled)

    late = [endpoint.by_shard[i] - early.by_shard.get(i, 0.0) for i in range(4)]
    spread = max(late) / min(late)
    if pooled:
        assert spread <= 1.25, late
        assert endpoint.refused_settled <= max(2, 0.02 * endpoint.answered), endpoint
    else:
        assert spread > 1.25, late  # what the pooling is for
