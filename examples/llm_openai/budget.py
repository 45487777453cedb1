"""The chat server's rate limits per key, as OpenAI and Anthropic enforce and state them.

A key has a requests budget and a tokens budget (``requests_per_minute``, ``tokens_per_minute``
per ``budget_window_seconds``), each a bucket refilled steadily up to its limit. A request is
charged one request and its tokens when it arrives: its text's UTF-8 bytes over 4, rounded up,
plus its ``max_tokens`` (OpenAI's rate limiter counts a request the same way, before it runs).
What does not fit is refused with ``429`` and the ``Retry-After`` after which it would fit, and
is not charged. Every answer, a refusal too, states the budgets in its API's headers:

- OpenAI: ``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``,
  ``x-ratelimit-reset-requests`` (a duration such as ``6m0s``, ``1.5s``, ``20ms``), the same for
  ``-tokens``;
- Anthropic: ``anthropic-ratelimit-requests-limit``, ``-remaining``, ``-reset`` (an RFC 3339
  time), the same for ``-tokens``.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass


@dataclass
class Bucket:
    """One budget: ``limit`` per ``window`` seconds, refilled steadily."""

    limit: float
    window: float
    level: float = math.nan
    at: float = 0.0

    def __post_init__(self) -> None:
        self.level = self.limit

    @property
    def per_second(self) -> float:
        return self.limit / self.window

    def refill(self, now: float) -> None:
        self.level = min(self.limit, self.level + self.per_second * (now - self.at))
        self.at = now

    def wait(self, cost: float) -> float:
        """Seconds until ``cost`` fits (0: it fits now)."""
        need = min(cost, self.limit) - self.level
        return max(need, 0.0) / self.per_second

    def reset(self) -> float:
        """Seconds until it is full again."""
        return (self.limit - self.level) / self.per_second


class KeyBudget:
    """The budgets of the one key the server knows; ``charge`` admits or refuses a request."""

    def __init__(
        self, requests_per_minute: int | None, tokens_per_minute: int | None, window: float
    ) -> None:
        self.buckets: dict[str, Bucket] = {}
        if requests_per_minute is not None:
            self.buckets["requests"] = Bucket(requests_per_minute * window / 60, window)
        if tokens_per_minute is not None:
            self.buckets["tokens"] = Bucket(tokens_per_minute * window / 60, window)
        self.charged_tokens = 0  # tokens of the requests admitted
        self.charged_requests = 0
        self.first_at: float | None = None  # when the first request was charged
        self.last_at: float | None = None  # when the last one was

    def charge(self, text_bytes: int, max_tokens: int, now: float) -> float:
        """Charge a request (0 returned) or say how long until it would fit."""
        cost = {"requests": 1, "tokens": math.ceil(text_bytes / 4) + max_tokens}
        for bucket in self.buckets.values():
            bucket.refill(now)
        wait = max((b.wait(cost[k]) for k, b in self.buckets.items()), default=0.0)
        if wait > 0:
            return wait
        for kind, bucket in self.buckets.items():
            bucket.level -= cost[kind]
        self.charged_tokens += cost["tokens"]
        self.charged_requests += 1
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        return 0.0

    @property
    def charged_seconds(self) -> float:
        """Seconds from the first request charged to the last."""
        if self.first_at is None or self.last_at is None:
            return 0.0
        return self.last_at - self.first_at

    def openai_headers(self) -> dict[str, str]:
        headers = {}
        for kind, b in self.buckets.items():
            headers[f"x-ratelimit-limit-{kind}"] = str(round(b.limit))
            headers[f"x-ratelimit-remaining-{kind}"] = str(math.floor(b.level))
            headers[f"x-ratelimit-reset-{kind}"] = duration(b.reset())
        return headers

    def anthropic_headers(self, wall: float) -> dict[str, str]:
        headers = {}
        for kind, b in self.buckets.items():
            when = dt.datetime.fromtimestamp(wall + b.reset(), dt.UTC)
            headers[f"anthropic-ratelimit-{kind}-limit"] = str(round(b.limit))
            headers[f"anthropic-ratelimit-{kind}-remaining"] = str(math.floor(b.level))
            headers[f"anthropic-ratelimit-{kind}-reset"] = when.isoformat(
                timespec="milliseconds"
            ).replace("+00:00", "Z")
        return headers


def duration(seconds: float) -> str:
    """Seconds as OpenAI writes a reset: ``20ms`` under a second, else ``1.5s``, ``6m0s``.

    >>> duration(0.02), duration(1.5), duration(360)
    ('20ms', '1.5s', '6m0s')
    """
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(round(seconds, 3), 60)
    return (f"{int(minutes)}m" if minutes else "") + f"{rest:g}s"
