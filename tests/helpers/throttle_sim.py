"""A simulated endpoint that drives a real ``Throttle`` on a fake clock, one call latency at a
time (``test_throttle_policy.py``, ``test_throttle_decisions.py``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from checkpoint_assets.engine.calls.refusals import Throttled
from checkpoint_assets.engine.calls.throttle import Throttle


@dataclass
class Simulated:
    """Drives a ``Throttle`` in steps of one call latency: every step, the calls the gate allows
    are sent; those above ``capacity(t)`` or refused at random (``p``) are refused with
    ``retry_after`` (held slots wait it out), the rest are answered.

    ``queued``: a server that queues what it cannot take (a vLLM, a proxy) instead of refusing
    it: calls above ``capacity(t)`` wait for a later step, and only that share of them is
    refused. ``queued=0.0`` with a low capacity is also a client short of CPU: the calls past
    what it can handle wait their turn."""

    gate: Throttle
    capacity: Callable[[float], int] = lambda t: 10**9
    p: float = 0.0
    latency: float = 0.05
    retry_after: float = 0.2
    seed: int = 0
    now: float = 0.0
    answered: int = 0
    refused: int = 0
    queued: float | None = None
    limits: list[int] = field(default_factory=list)
    _waiting: list[float] = field(default_factory=list)  # when each held slot may retry
    _queue: int = 0  # calls the server has not taken in yet

    def step(self) -> None:
        rng = random.Random(f"{self.seed}:{self.now:.3f}")
        self.now = max(self.now, self.gate.resume_at)
        ready = [w for w in self._waiting if w <= self.now]
        self._waiting = [w for w in self._waiting if w > self.now]
        for _ in ready:
            self.gate.release(False)  # the refused call queues again
        sent = 0
        while self.gate.in_flight < self.gate.limit:
            self.gate.acquire()
            sent += 1
        admitted = self.capacity(self.now)
        start = self.now
        if self.queued is not None:  # the queue first, then the new calls; the rest wait
            waiting, self._queue = self._queue, 0
            for i in range(admitted, waiting + sent):
                if i >= waiting and rng.random() < self.queued:
                    self.refused += 1
                    asked = Throttled(self.retry_after, "HTTP 429")
                    self._waiting.append(start + self.gate.throttle(asked))
                else:
                    self._queue += 1
            sent = min(admitted, waiting + sent)
        for i in range(sent):
            self.now = start + self.latency * (i + 1) / sent  # the answers of a step spread over it
            if i >= admitted or rng.random() < self.p:
                self.refused += 1
                delay = self.gate.throttle(Throttled(self.retry_after, "HTTP 429"))
                self._waiting.append(self.now + delay)
            else:
                self.answered += 1
                self.gate.release(True)
        self.now = start + self.latency
        self.limits.append(self.gate.limit)

    def run(self, seconds: float) -> list[int]:
        end = self.now + seconds
        first = len(self.limits)
        while self.now < end:
            self.step()
        return self.limits[first:]
