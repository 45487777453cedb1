"""The throttle's policy, deterministically: a simulated endpoint drives the real ``Throttle`` on
a fake clock, call by call. Sporadic refusals are not a limit; a limit is found, settled near,
and found again when it moves, with or without the endpoint's own refusals on top; a client
short of CPU is not taken for a limit; ``min_concurrency`` and ``adaptive_concurrency=False``
hold; the shard pauses only when most calls are refused. What holds under real threads and tasks:
``test_throttle.py``."""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest
from helpers.throttle_sim import Simulated

from checkpoint_assets.engine.calls.refusals import Throttled
from checkpoint_assets.engine.calls.throttle import Throttle
from checkpoint_assets.engine.settings import Settings


def _gate(max_concurrency: int = 32, **kw: Any) -> tuple[Throttle, list[float]]:
    clock = [0.0]
    settings = Settings("id", max_concurrency=max_concurrency, **kw)
    return Throttle(settings, clock=lambda: clock[0]), clock


def _simulated(max_concurrency: int = 32, **kw: Any) -> Simulated:
    named = {k: kw.pop(k) for k in ("min_concurrency", "adaptive_concurrency") if k in kw}
    gate, _ = _gate(max_concurrency, **named)  # its clock at 0 until the endpoint's takes over
    sim = Simulated(gate, **kw)
    gate.clock = lambda: sim.now
    return sim


def _clean_round(gate: Throttle) -> None:
    for _ in range(max(16, 2 * gate.limit)):
        gate.acquire()
        gate.release(True)


def _streak(gate: Throttle) -> None:
    """Every allowed call sent, eight refused in a row, then all of them queued again."""
    calls = gate.limit
    for _ in range(calls):
        gate.acquire()
    for _ in range(8):
        gate.throttle(Throttled(0.0, "HTTP 429"))
    for _ in range(calls):
        gate.release(False)


def _refused_round(gate: Throttle, every: int = 7) -> None:
    """A round with every ``every``-th call refused: more than usual, never a streak."""
    for i in range(max(16, 2 * gate.limit)):
        gate.acquire()
        if i % every == every - 1:
            gate.throttle(Throttled(0.0, "HTTP 429"))
            gate.release(False)
        else:
            gate.release(True)


@pytest.mark.parametrize("p", [0.01, 0.05, 0.2])
def test_sporadic_refusals_keep_concurrency_at_its_maximum(p: float) -> None:
    sim = _simulated(32, p=p)

    limits = sim.run(30)

    assert sim.refused > 0
    # A trial now and then (one round at half) to tell them from a limit; never a collapse.
    assert sum(limits) / len(limits) >= 0.9 * 32, f"{p:.0%} random refusals lowered concurrency"
    assert limits[-1] == 32 and min(limits) >= 16
    assert sim.gate.background <= p + 0.1  # learned as the endpoint's own


def test_sporadic_refusals_to_a_client_short_of_cpu_are_not_taken_for_a_limit() -> None:
    # A client sharing its CPU with everything else answers about as many calls with half of
    # them in flight, so a trial keeps its answers whatever the refusals are. Refusals that
    # stayed with half the calls are the endpoint's own, not a limit's. (A trial round can
    # still show none by chance: eight runs, judged as a whole.)
    levels, kept = [], []
    for seed in range(8):
        ours = _simulated(32, capacity=lambda t: 12, queued=0.0, p=0.05, seed=seed)
        loop = _simulated(
            32, capacity=lambda t: 12, queued=0.0, p=0.05, seed=seed, adaptive_concurrency=False
        )
        limits = ours.run(30)
        loop.run(30)
        levels.append(sum(limits) / len(limits))
        kept.append(ours.answered / loop.answered)

    assert statistics.median(levels) >= 0.95 * 32, "random refusals lowered concurrency"
    # A share learned only downwards would keep some seeds below 0.95 of the loop.
    assert min(kept) >= 0.95


def test_over_a_limit_concurrency_settles_near_it() -> None:
    sim = _simulated(64, capacity=lambda t: 16)

    limits = sim.run(30)[-200:]  # the last 10 s

    assert 12 <= sum(limits) / len(limits) <= 22, "concurrency should settle near 16"
    assert sim.gate.background < 0.1, "refusals caused by concurrency are not background"


@pytest.mark.parametrize("limit", [16, 32])
def test_started_above_a_limit_a_shard_answers_as_many_calls_as_a_loop_held_at_it(
    limit: int,
) -> None:
    # Calls refused past a limit wait their Retry-After holding their slots, so a shard a few
    # calls over it sees few refusals and loses little; halving to tell, or stepping back
    # further than the answers say, is what costs.
    ours = _simulated(64, capacity=lambda t: limit)
    loop = _simulated(limit, capacity=lambda t: limit, adaptive_concurrency=False)

    ours.run(30)
    loop.run(30)

    assert ours.answered >= 0.96 * loop.answered


def test_a_shard_holds_no_more_calls_than_a_server_that_queues_past_its_limit_takes() -> None:
    # Such a server refuses only now and then, and what it does not take waits in its queue:
    # the client pays for every call it holds (connections, their turns on the CPU) and gets
    # no more answers. A round with more refusals than usual is no ground to grow on, and a
    # refused level that passes later is probed past a call or two at a time, not a quarter.
    ours = _simulated(64, capacity=lambda t: 32, queued=0.15)
    loop = _simulated(32, capacity=lambda t: 32, adaptive_concurrency=False)

    limits = ours.run(30)[40:]  # from 2 s on
    loop.run(30)

    assert max(limits) <= 40, "it went on far past the calls the server takes in"
    assert sum(limits[-200:]) / 200 <= 36
    assert ours.answered >= 0.96 * loop.answered


def test_a_limit_that_drops_and_returns_is_found_again() -> None:
    sim = _simulated(32, capacity=lambda t: 8 if 10 <= t < 20 else 32)

    sim.run(10)
    low = sim.run(10)
    back = sim.run(10)

    assert sum(low[-100:]) / 100 <= 14, "the lower limit was found"
    steps = next(i for i, limit in enumerate(back) if limit >= 0.8 * 32)
    assert steps * sim.latency < 3.0, "back near the limit within seconds of its return"
    assert sum(back[-100:]) / 100 >= 28


@pytest.mark.parametrize(("latency", "median", "worst"), [(0.05, 3.0, 10.0), (0.25, 15.0, 59.0)])
def test_a_limit_that_drops_and_returns_is_found_again_through_the_endpoints_own_refusals(
    latency: float, median: float, worst: float
) -> None:
    # The endpoint refuses 5 % of calls whatever the shard does. What the shard learns of that
    # share follows the rounds both ways: if it only went down, it would settle below the true
    # share, every round at the endpoint's own share would look like a few refusals too many,
    # and the shard would hardly grow again.
    back = []
    for seed in range(8):
        sim = _simulated(
            32, capacity=lambda t: 8 if 10 <= t < 20 else 32, p=0.05, latency=latency, seed=seed
        )
        sim.run(20)
        limits = sim.run(60)
        steps = next((i for i, limit in enumerate(limits) if limit >= 0.8 * 32), None)
        back.append(math.inf if steps is None else steps * latency)

    assert statistics.median(back) <= median, back
    assert max(back) <= worst, back


@pytest.mark.parametrize("latency", [0.05, 0.25])
def test_a_limit_that_returns_is_found_again_within_a_few_seconds_of_slow_answers(
    latency: float,
) -> None:
    # Slow answers give fewer of them per second to learn from. Once the level refused at the
    # lower limit passes, the limit moved: each clean round probes twice as far as the last.
    # At 250 ms that is 13 answers' time (3.25 s); at 50 ms the wait before a refused level is
    # tried again (2 s at most) takes most of the 40.
    sim = _simulated(32, capacity=lambda t: 8 if 10 <= t < 20 else 32, latency=latency)
    sim.run(20)
    refused = sim.refused

    back = sim.run(10)

    answers = next(i for i, limit in enumerate(back) if limit >= 0.8 * 32)
    assert answers <= 13 if latency == 0.25 else answers <= 40, answers  # answers' time
    assert sim.refused - refused <= 1  # a call sent at the lower limit at most
    assert back[-1] == 32


def test_a_streak_in_a_trial_is_a_limit_below_half_not_the_endpoints_refusals() -> None:
    # The limit drops while a trial runs at half the calls: most of the trial's calls are
    # refused, in a row. That is no background share to learn (a learned share of 1 would
    # take every later refusal for the endpoint's own); the streak halves again.
    gate, _ = _gate(32)
    _refused_round(gate)  # 9 of 64 refused at a clean level: a trial at 16
    assert gate.limit == 16
    for _ in range(16):
        gate.acquire()
    for _ in range(16):
        gate.throttle(Throttled(0.0, "HTTP 429"))

    assert gate.limit == 8 and gate.background == 0.0


def test_a_level_held_for_the_endpoints_refusals_is_not_held_below_a_limit_found_later() -> None:
    # A trial said the refusals were the endpoint's own: the level holds for a few rounds. A
    # streak then shows a limit below it. The hold was for that level, not for half of it:
    # growth resumes as soon as the lower level is good.
    gate, _ = _gate(32)
    _refused_round(gate)  # 9 of 64 refused at a clean level: a trial at 16
    assert gate.limit == 16
    _refused_round(gate)
    _refused_round(gate)  # as many refused with half the calls: the endpoint's own; back to 32
    assert gate.limit == 32
    _streak(gate)  # then a streak: over a limit, halve at once
    assert gate.limit == 16

    for _ in range(3):  # two clean rounds make it good (a level was refused), the third grows
        _clean_round(gate)
    assert gate.limit == 20


def test_sporadic_refusals_on_top_of_a_limit_are_learned_not_chased_down() -> None:
    sim = _simulated(64, capacity=lambda t: 24, p=0.1)

    limits = sim.run(40)[-200:]

    assert 18 <= sum(limits) / len(limits) <= 40
    assert min(limits) >= 8, "random refusals must not ratchet concurrency down"


def test_min_concurrency_is_the_floor_and_adaptation_can_be_turned_off() -> None:
    floored = _simulated(32, capacity=lambda t: 2, min_concurrency=8)
    assert min(floored.run(10)) == 8

    fixed = _simulated(32, capacity=lambda t: 8, adaptive_concurrency=False)
    assert set(fixed.run(10)) == {32}, "adaptive_concurrency=False keeps max_concurrency"
    assert fixed.answered > 0


def test_a_trial_waits_for_enough_refusals_to_tell_a_limit_from_chance() -> None:
    # Half the calls for a round at the endpoint's own 1 % would show no refusal half the
    # time: three refusals in a round are too few for a trial to tell anything. Such rounds
    # add up, and the level holds until they do.
    gate, _ = _gate(32)
    _refused_round(gate, every=21)  # 3 of 64: more than chance at no refusal, too few to try
    assert gate.limit == 32 and gate.events == 0

    _refused_round(gate, every=21)  # 6 of 128: a trial
    assert gate.limit == 16 and gate.events == 1


def test_refused_just_below_a_refused_level_a_shard_steps_down_an_eighth_before_a_trial() -> None:
    # The level a client holds against a server's limit drifts with its own CPU (calls being
    # sent or read count on its side only), so a level that passed can be refused later. Just
    # below a level refused for concurrency, that is the limit: an eighth lower, not half the
    # calls for a round (a trial, which costs answers and leaves connections idle).
    gate, _ = _gate(36)
    _streak(gate)  # over a limit, halve at once
    levels = []
    while gate.limit < 35:  # clean rounds: up to just below the refused level
        levels.append(gate.limit)
        _clean_round(gate)
    good = levels[-1]
    _refused_round(gate)  # refused at 35, past the last good level: back to it
    assert gate.limit == good == 34

    _refused_round(gate)  # refused at the good level itself, 35 just above it
    assert gate.limit == 34 - 34 // 8

    _refused_round(gate)  # and again: now a trial tells a limit from the endpoint's refusals
    assert gate.limit == 30 // 2


def test_growth_stops_below_a_refused_level_until_it_is_forgotten_after_30_seconds() -> None:
    gate, clock = _gate(32)
    _streak(gate)  # eight refusals in a row: over a limit, halve at once
    assert gate.limit == 16 and gate.events == 1
    # Past a refusal a level is good after two clean rounds in a row; then a quarter more,
    # half way to the refused level (32) at most, up to just below it ...
    levels = []
    for _ in range(10):
        _clean_round(gate)
        levels.append(gate.limit)
    assert levels == [16, 20, 20, 25, 25, 28, 28, 30, 30, 31]
    gate.max = 64  # (so that growth past the refused level shows)
    _clean_round(gate)
    _clean_round(gate)
    assert gate.limit == 32  # ... then one more, while it is remembered.
    # A level refused that passes now: probed past one, then two, then four more at a time,
    # not a quarter (a server that queues refuses a few calls over its limit only seldom).
    # The refused level took two clean rounds; once it passed, the limit moved: one each.
    probed = []
    for _ in range(5):
        _clean_round(gate)
        probed.append(gate.limit)
    assert probed == [32, 33, 35, 39, 47]
    # Forgotten 30 s after the refusal: a quarter more per clean round again.
    clock[0] = 31.0
    _clean_round(gate)
    assert gate.limit == 47 + 47 // 4


def test_most_calls_of_a_round_refused_pause_the_whole_shard() -> None:
    gate, _ = _gate(4)
    for _ in range(4):
        gate.acquire()
    for _ in range(4):  # a streak as long as the limit, all refused
        gate.throttle(Throttled(1.5, "HTTP 429"))
    assert gate.resume_at == pytest.approx(1.5) and gate.throttled_seconds == pytest.approx(1.5)


def test_one_refusal_pauses_nothing_but_its_own_call() -> None:
    gate, _ = _gate(32)
    for _ in range(32):
        gate.acquire()
    delay = gate.throttle(Throttled(0.2, "HTTP 429"))
    assert delay == 0.2 and gate.resume_at == 0.0 and gate.events == 0
    assert gate.in_flight == 32, "a refused call keeps its slot while it waits"
    assert gate.throttle(Throttled(None, "HTTP 503"), refusals=2) == 4.0  # base 1 s, doubled
