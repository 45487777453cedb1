"""The throttle's policy alone, round by round, with no gate, lock or clock: what it answers to a
round and what it remembers (``engine/calls/adaptation.py``)."""

from __future__ import annotations

from checkpoint_assets.engine.calls.adaptation import (
    Adaptation,
    Ceiling,
    CleanRun,
    NewLimit,
    Round,
    Shares,
    Tally,
    Trial,
)


def _round(answered: int, refused: int = 0, seconds: float = 1.0, over: bool = False) -> Round:
    return Round(answered, refused, seconds, over)


def test_a_clean_round_grows_the_limit_by_a_quarter() -> None:
    policy = Adaptation(floor=1)

    assert policy.judge(_round(64), limit=32, now=1.0) == NewLimit(40)
    assert policy.good == 32 and policy.clean == CleanRun(32, 1)


def test_refusals_too_few_for_a_trial_add_up_at_one_level_then_halve_for_a_trial() -> None:
    policy = Adaptation(floor=1)
    assert policy.judge(_round(64), limit=32, now=1.0) is not None  # a rate to compare with

    assert policy.judge(_round(64, 3), limit=32, now=2.0) is None  # 3 of 64: hold
    assert policy.tally == Tally(32, 64, 3)
    cut = policy.judge(_round(64, 3), limit=32, now=3.0)  # 6 of 128: a trial at half

    assert cut == NewLimit(16, cut=True)
    assert policy.trial == Trial(level=32, rate=policy.rate, share=6 / 128, calls=128)
    assert policy.tally == Tally()
    assert policy.round_size(16) == 128  # the trial lasts as many calls as what started it


def test_refusals_that_stay_with_half_the_calls_are_learned_as_the_endpoints() -> None:
    policy = Adaptation(floor=1)
    policy.judge(_round(64), limit=32, now=1.0)
    policy.judge(_round(64, 3), limit=32, now=2.0)
    policy.judge(_round(64, 3), limit=32, now=3.0)  # a trial at 16

    back = policy.judge(_round(128, 6, seconds=2.0), limit=16, now=5.0)

    assert back == NewLimit(32)
    assert policy.trial is None and policy.good == 32
    assert policy.shares.background == 6 / 128


def test_a_streak_halves_not_below_the_floor_and_remembers_the_refused_level() -> None:
    policy = Adaptation(floor=12)

    assert policy.judge(_round(8, 8, over=True), limit=32, now=4.0) == NewLimit(16, cut=True)
    assert policy.ceiling == Ceiling(32, 4.0)
    assert policy.judge(_round(8, 8, over=True), limit=16, now=5.0) == NewLimit(12, cut=True)
    assert policy.judge(_round(8, 8, over=True), limit=12, now=6.0) is None  # at the floor


def test_the_learned_share_follows_rounds_both_ways_but_never_above_what_trials_found() -> None:
    shares = Shares()
    shares.learn(0.05, 64)
    assert shares.background == shares.learned == 0.05
    ceiling = shares.found

    for _ in range(200):
        shares.follow(0.5)
    assert shares.learned <= ceiling and shares.background <= shares.learned
    for _ in range(200):
        shares.follow(0.0)
    assert shares.background < 0.001
