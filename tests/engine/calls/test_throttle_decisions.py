"""The throttle decides as it did when ``throttle_decisions.json`` was recorded: over seeded random
scenarios, every change of its limit, its pauses and its events, the delay of every refused
call, and what it learned, to the last bit.

A simulated endpoint (``helpers/throttle_sim.py``) drives it through limits that drop and
return, the endpoint's own refusals, and a server that queues; a random client sends, answers
and refuses calls one at a time, with random ``Retry-After``\\ s and clock steps. The fixture was
recorded from the code before its adaptation became a policy of its own; record it again
(``python tests/engine/test_throttle_decisions.py``) only for a change meant to alter decisions.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[2]))

from helpers.throttle_sim import Simulated

from checkpoint_assets.engine.calls.refusals import Throttled
from checkpoint_assets.engine.calls.throttle import Throttle
from checkpoint_assets.engine.settings import Settings

FIXTURE = Path(__file__).parent / "throttle_decisions.json"
Scenario = dict[str, Any]

# Capacities: (from, to, calls admitted) in seconds of the fake clock.
_DROP = [[0, 10, 32], [10, 20, 8], [20, 1e9, 32]]
SCENARIOS: list[Scenario] = [
    {"kind": "sim", "seed": 0, "max": 32, "p": 0.05, "seconds": 30},
    {"kind": "sim", "seed": 1, "max": 64, "capacity": [[0, 1e9, 16]], "seconds": 30},
    {"kind": "sim", "seed": 2, "max": 32, "capacity": _DROP, "p": 0.05, "seconds": 40},
    {"kind": "sim", "seed": 3, "max": 32, "capacity": _DROP, "latency": 0.25, "seconds": 40},
    {"kind": "sim", "seed": 4, "max": 64, "capacity": [[0, 1e9, 32]], "queued": 0.15},
    {"kind": "sim", "seed": 5, "max": 32, "capacity": [[0, 1e9, 12]], "queued": 0.0, "p": 0.05},
    {"kind": "sim", "seed": 6, "max": 64, "capacity": [[0, 1e9, 24]], "p": 0.1, "seconds": 40},
    {"kind": "sim", "seed": 7, "max": 32, "capacity": [[0, 1e9, 2]], "min": 8, "seconds": 10},
    {"kind": "sim", "seed": 8, "max": 32, "capacity": [[0, 1e9, 8]], "adaptive": False},
    {"kind": "sim", "seed": 15, "max": 32, "capacity": [[0, 1e9, 22]], "queued": 0.15},
    {"kind": "sim", "seed": 1, "max": 32, "capacity": [[0, 1e9, 20]], "queued": 0.15},
    {"kind": "sim", "seed": 16, "max": 32, "capacity": [[0, 1e9, 21]], "queued": 0.1, "p": 0.01},
    {"kind": "sim", "seed": 17, "max": 160, "capacity": [[0, 1e9, 140]], "p": 0.01, "seconds": 20},
    {"kind": "sim", "seed": 18, "max": 256, "capacity": [[0, 1e9, 200]], "queued": 0.1},
    {"kind": "ops", "seed": 10, "max": 24, "steps": 6000},
    {"kind": "ops", "seed": 11, "max": 48, "min": 3, "steps": 6000, "p": 0.05},
    {"kind": "ops", "seed": 12, "max": 8, "steps": 4000, "max_seconds": 30.0},
    {"kind": "ops", "seed": 13, "max": 16, "steps": 4000, "adaptive": False},
    {"kind": "ops", "seed": 14, "max": 4, "steps": 3000, "p": 0.5, "max_seconds": 4.0},
]


def throttle(scenario: Scenario, clock: Callable[[], float]) -> Throttle:
    """The throttle a scenario drives, on ``clock``."""
    settings = Settings(
        "id",
        max_concurrency=scenario["max"],
        max_throttle_seconds=scenario.get("max_seconds", 600.0),
        min_concurrency=scenario.get("min", 1),
        adaptive_concurrency=scenario.get("adaptive", True),
    )
    return Throttle(settings, clock=clock)


def _state(gate: Throttle) -> list[Any]:
    return [gate.limit, gate.events, gate.resume_at, gate.throttled_seconds]


def _simulated(scenario: Scenario) -> dict[str, Any]:
    """Every step at which the simulated endpoint saw the throttle's state change."""
    steps = scenario.get("capacity", [[0, 1e9, 10**9]])
    now = [0.0]
    gate = throttle(scenario, lambda: now[0])
    sim = Simulated(
        gate,
        capacity=lambda t: next(c for lo, hi, c in steps if lo <= t < hi),
        p=scenario.get("p", 0.0),
        latency=scenario.get("latency", 0.05),
        queued=scenario.get("queued"),
        seed=scenario["seed"],
    )
    gate.clock = lambda: sim.now
    changes, last = [], None
    while sim.now < scenario.get("seconds", 30):
        sim.step()
        state = _state(gate)
        if state != last:
            changes.append([len(sim.limits), *state])
            last = state
    end = [sim.answered, sim.refused, gate.refusals, gate.background, gate.spent]
    return {"changes": changes, "end": end}


def _random_client(scenario: Scenario) -> dict[str, Any]:
    """A client that, at random, sends a call the gate admits, or has one answered or refused
    (refused more often past a capacity that moves), one at a time on a clock that jumps."""
    rng = random.Random(scenario["seed"])
    now = [0.0]
    gate = throttle(scenario, lambda: now[0])
    p = scenario.get("p", 0.02)
    capacity = scenario["max"]
    flying = 0  # admitted and not yet answered
    waiting: list[float] = []  # refused calls holding their slots: when each queues again
    changes: list[list[Any]] = []
    delays: list[float] = []
    last = None
    for step in range(scenario["steps"]):
        now[0] += rng.choice([0.0, 0.0, 0.001, 0.01, 0.05, 0.3])
        for when in [w for w in waiting if w <= now[0]]:
            waiting.remove(when)
            gate.release(False)
        draw = rng.random()
        if draw < 0.01:
            capacity = rng.randint(1, scenario["max"])
        free = gate.spent is None and gate.in_flight < gate.limit and now[0] >= gate.resume_at
        if draw < 0.5 and free:
            gate.acquire()
            flying += 1
        elif flying:
            flying -= 1
            if rng.random() < (0.6 if gate.in_flight > capacity else p):
                asked = rng.choice([None, 0.0, 0.05, 0.2, 1.5])
                delay = gate.throttle(Throttled(asked, "HTTP 429"), rng.randint(0, 3))
                delays.append(delay)
                waiting.append(now[0] + delay)
            else:
                gate.release(True)
        state = _state(gate)
        if state != last:
            changes.append([step, *state])
            last = state
    end = [gate.refusals, gate.background, gate.spent]
    return {"changes": changes, "delays": delays, "end": end}


def decisions(scenario: Scenario) -> dict[str, Any]:
    """What the throttle decided over ``scenario``, as JSON values (floats exactly)."""
    run = _simulated if scenario["kind"] == "sim" else _random_client
    return json.loads(json.dumps(run(scenario)))


@pytest.mark.parametrize("index", range(len(SCENARIOS)))
def test_the_throttle_decides_as_recorded(index: int) -> None:
    recorded = json.loads(FIXTURE.read_text())
    assert recorded[index]["scenario"] == SCENARIOS[index]

    assert decisions(SCENARIOS[index]) == recorded[index]["decisions"]


def test_the_recorded_scenarios_exercise_the_policy() -> None:
    # A fixture of scenarios in which nothing happens would prove nothing: each adaptive one
    # changes the limit, some pause the shard, and one stops it.
    recorded = json.loads(FIXTURE.read_text())
    for r in recorded:
        limits = {change[1] for change in r["decisions"]["changes"]}
        assert len(limits) >= 2 or not r["scenario"].get("adaptive", True), r["scenario"]
    assert any(change[3] > 0 for r in recorded for change in r["decisions"]["changes"])
    assert any(r["decisions"]["end"][-1] for r in recorded)  # a quota looked spent


if __name__ == "__main__":  # record the fixture from the code as it is
    FIXTURE.write_text(
        json.dumps([{"scenario": s, "decisions": decisions(s)} for s in SCENARIOS]) + "\n"
    )
