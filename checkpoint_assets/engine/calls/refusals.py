"""What counts as a refusal (the endpoint saying "not now") and how long it asked to wait.

A refusal is one of these:

- the function raises :class:`RetryAfter`;
- an HTTP error with status 429, 503 or 529 (Anthropic's ``overloaded_error``);
- any other 5xx that carries ``Retry-After``.

HTTP errors are ``httpx.HTTPStatusError``, the ``openai`` and ``anthropic`` clients' errors, or
anything with ``.response.status_code``. A refusal is not a failure of the rows. The call does
not count as an attempt, marks no row failed and is not part of an outage streak. A 5xx
without ``Retry-After`` is an ordinary failed call, retried as any other.

How the shard answers refusals (waits, concurrency, pauses) is ``throttle.py``'s.

A spent quota is no refusal: waiting does not help. ``quota_spent`` recognises the errors that
say so, OpenAI's ``insufficient_quota`` (a 429) and Anthropic's spend limits and credit balance
(a 400), so the shard stops at once, keeping what is done, instead of waiting or retrying.
"""

from __future__ import annotations

import email.utils
import time
from dataclasses import dataclass
from typing import Any

THROTTLE_STATUSES = frozenset({429, 503, 529})  # rate limited, unavailable, overloaded


class RetryAfter(Exception):
    """Raised by a checkpointed function: the endpoint is rate limiting; call again later.

    Every worker of the shard pauses for ``seconds`` (or an exponential back-off when None), then
    the same batch is called again. It is not an attempt, not a row failure and not an outage.

    Example::

        if response.status_code == 429:
            raise RetryAfter(float(response.headers.get("retry-after", 1)))
    """

    def __init__(self, seconds: float | None = None, message: str = "") -> None:
        self.seconds = None if seconds is None else max(0.0, float(seconds))
        wait = "" if seconds is None else f" (retry after {self.seconds:g} s)"
        super().__init__(message or f"rate limited{wait}")


@dataclass(frozen=True)
class Throttled:
    """A call was throttled; ``seconds`` is what the endpoint asked for, if it said."""

    seconds: float | None
    reason: str


def throttled(error: BaseException) -> Throttled | None:
    """Whether ``error`` is the endpoint rate limiting, and for how long it asked to wait.

    Follows ``__cause__`` (a function that wraps the HTTP error in its own is still throttled).
    """
    seen = 0
    current: BaseException | None = error
    while current is not None and seen < 5:
        if isinstance(current, RetryAfter):
            return Throttled(current.seconds, str(current))
        if quota_spent(current) is not None:
            return None
        status, headers = _status_and_headers(current)
        if status in THROTTLE_STATUSES:
            return Throttled(retry_after_seconds(headers), f"HTTP {status}")
        if status is not None and status >= 500:
            wait = retry_after_seconds(headers)
            if wait is not None:  # the server said when to come back
                return Throttled(wait, f"HTTP {status}")
        current = current.__cause__
        seen += 1
    return None


# Anthropic's words for a spent spend limit or credit balance (a 400 invalid_request_error).
_SPENT_WORDS = ("usage limits", "spend limit", "credit balance is too low")


def quota_spent(error: BaseException) -> str | None:
    """The quota ``error`` says is spent, in words naming it; None for any other error.

    Follows ``__cause__`` as :func:`throttled` does."""
    seen = 0
    current: BaseException | None = error
    while current is not None and seen < 5:
        body = getattr(current, "body", None)
        found = body.get("error", body) if isinstance(body, dict) else None
        if isinstance(found, dict):
            code, message = found.get("code"), str(found.get("message") or "")
            if code == "insufficient_quota":
                return f"OpenAI says the account's quota is spent (insufficient_quota: {message})"
            if any(words in message.lower() for words in _SPENT_WORDS):
                return f"the provider says a spend limit is reached ({message})"
        current = current.__cause__
        seen += 1
    return None


def _status_and_headers(error: BaseException) -> tuple[int | None, Any]:
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if status is None:
        status = getattr(error, "status_code", None)
    headers = getattr(response, "headers", None)
    return (status if isinstance(status, int) else None), headers


def retry_after_seconds(headers: Any, now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date)."""
    if not headers:
        return None
    get = headers.get
    ms = get("retry-after-ms") or get("Retry-After-Ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = get("retry-after") or get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(str(value))
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
