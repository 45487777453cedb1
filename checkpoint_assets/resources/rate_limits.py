"""The provider's side of pacing: what a request costs, what an answer says of the limits.

The endpoint resources build their clients on an HTTP client with two event hooks
(:class:`Hooks`). Before a model request is sent, it waits in the key's
:class:`~checkpoint_assets.engine.calls.pacing.Pacer` until its estimated cost fits. When the
answer comes, its rate-limit headers go back to the pacer. Requests of other APIs (batches,
files) pass untouched.

- **Cost** (:func:`estimate`): the request's text in UTF-8 bytes over 4, rounded up (no
  tokenizer), and its
  ``max_tokens`` (``max_completion_tokens``, ``max_output_tokens``) as output.
- **Headers** (:func:`stated`), on every answer, a 429 too:

  - OpenAI: ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, resets as durations
    (``6m0s``, ``1.5s``, ``20ms``);
  - Anthropic: ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,
    remaining,reset}``, resets as RFC 3339 times;
  - the IETF fields, for requests: ``RateLimit`` with ``RateLimit-Policy`` (``r``, ``t``; ``q``,
    ``w``), or ``RateLimit-Limit``, ``RateLimit-Remaining`` and ``RateLimit-Reset``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import json
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from checkpoint_assets.engine.calls import pacing
from checkpoint_assets.resources.peers import INTERVAL_SECONDS, JOIN_SECONDS, Peers

#: The paths of model requests, which are paced; every other request passes.
_PACED: Final = ("/chat/completions", "/completions", "/embeddings", "/responses", "/messages")
_TICKET: Final = "checkpoint_assets.pacing_ticket"  # a request's ticket, in its extensions
_OUTPUT_KEYS: Final = ("max_tokens", "max_completion_tokens", "max_output_tokens")
_TEXT_KEYS: Final = ("content", "text", "input")
_DURATION: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|m|s|us|µs|ns)")
_UNIT_SECONDS: Final = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_OPENAI: Final = {"requests": "requests", "tokens": "tokens"}
_ANTHROPIC: Final = {
    "requests": "requests",
    "tokens": "tokens",
    "input_tokens": "input-tokens",
    "output_tokens": "output-tokens",
}


def duration_seconds(text: str) -> float | None:
    """A Go-style duration (``6m0s``, ``1.5s``, ``20ms``, ``1h2m3s``) or plain seconds, in
    seconds; None when it is neither.

    >>> duration_seconds("6m0s"), duration_seconds("1.5s"), duration_seconds("20ms")
    (360.0, 1.5, 0.02)
    """
    text = text.strip()
    try:
        return max(float(text), 0.0)
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return float(sum(float(n) * _UNIT_SECONDS[u] for n, u in parts))


def rfc3339_seconds(text: str, now: float) -> float | None:
    """Seconds from ``now`` (a POSIX time) to an RFC 3339 time; None when it is not one."""
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("z", "Z"))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return max(when.timestamp() - now, 0.0)


def stated(headers: Mapping[str, str], now: float | None = None) -> dict[str, pacing.Limit]:
    """The budgets an answer's headers state, by kind (``pacing.KINDS``); ``now``: the POSIX
    time that Anthropic's reset times count from (default: this machine's)."""
    wall = time.time() if now is None else now
    found: dict[str, pacing.Limit] = {}
    for kind, name in _OPENAI.items():
        limit = _limit(headers, f"x-ratelimit-%s-{name}", duration_seconds)
        if limit is not None:
            found[kind] = limit
    for kind, name in _ANTHROPIC.items():
        limit = _limit(
            headers, f"anthropic-ratelimit-{name}-%s", lambda t: rfc3339_seconds(t, wall)
        )
        if limit is not None:
            found[kind] = limit
    if "requests" not in found:
        ietf = _ietf(headers)
        if ietf is not None:
            found["requests"] = ietf
    return found


def _limit(
    headers: Mapping[str, str], pattern: str, reset: Callable[[str], float | None]
) -> pacing.Limit | None:
    limit, remaining = (
        _number(headers.get(pattern % "limit")),
        _number(headers.get(pattern % "remaining")),
    )
    if limit is None or remaining is None or limit <= 0:
        return None
    text = headers.get(pattern % "reset")
    seconds = reset(text) if text is not None else None
    return pacing.Limit(limit, min(max(remaining, 0.0), limit), seconds or 0.0)


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text.split(",")[0].split(";")[0])
    except ValueError:
        return None


def _ietf(headers: Mapping[str, str]) -> pacing.Limit | None:
    """The requests budget of the IETF fields: the structured ``RateLimit`` and
    ``RateLimit-Policy`` of the current draft, or the earlier separate fields."""
    current = headers.get("ratelimit")
    if current is not None:
        policies = {name: params for name, params in _items(headers.get("ratelimit-policy", ""))}
        for name, params in _items(current):
            policy = policies.get(name, {})
            if policy.get("qu", "requests") != "requests":
                continue
            quota, remaining = _number(policy.get("q")), _number(params.get("r"))
            reset = _number(params.get("t"))
            if remaining is None or reset is None:
                continue
            quota = quota if quota is not None else remaining
            return pacing.Limit(quota, min(remaining, quota), reset, steady=False)
        # The intermediate draft: "limit=100, remaining=50, reset=30".
        fields = dict(_pairs(current))
        limit, remaining, reset = (_number(fields.get(k)) for k in ("limit", "remaining", "reset"))
        if limit and remaining is not None and reset is not None:
            return pacing.Limit(limit, min(remaining, limit), reset, steady=False)
        return None
    limit = _number(headers.get("ratelimit-limit"))
    remaining = _number(headers.get("ratelimit-remaining"))
    reset = _number(headers.get("ratelimit-reset"))
    if limit and remaining is not None and reset is not None:
        return pacing.Limit(limit, min(remaining, limit), reset, steady=False)
    return None


def _items(text: str) -> list[tuple[str, dict[str, str]]]:
    """A structured-field list of ``"name";key=value`` items."""
    items = []
    for item in text.split(","):
        name, *params = (p.strip() for p in item.split(";"))
        if name:
            items.append((name.strip('"'), dict(_pairs(";".join(params), sep=";"))))
    return items


def _pairs(text: str, sep: str = ",") -> list[tuple[str, str]]:
    pairs = []
    for part in text.split(sep):
        key, eq, value = part.strip().partition("=")
        if eq:
            pairs.append((key.strip().lower(), value.strip().strip('"')))
    return pairs


def estimate(body: bytes) -> tuple[float, float]:
    """A request's (input, output) tokens: its text's UTF-8 bytes over 4, and its output limit.

    >>> estimate(b'{"messages": [{"role": "user", "content": "refund me"}], "max_tokens": 8}')
    (3.0, 8.0)
    """
    try:
        payload = json.loads(body)
    except ValueError:
        return len(body) / 4, 0.0
    if not isinstance(payload, dict):
        return len(body) / 4, 0.0
    text = sum(_text_bytes(payload.get(k)) for k in ("messages", "system", "input", "prompt"))
    output = next((payload[k] for k in _OUTPUT_KEYS if isinstance(payload.get(k), int)), 0)
    return float(math.ceil(text / 4)), float(output)


def _text_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, list):
        return sum(_text_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_text_bytes(value.get(k)) for k in _TEXT_KEYS)
    return 0


def _set(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _wake_future(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    """Wake a request waiting on ``loop``, from any thread."""
    if asyncio._get_running_loop() is loop:
        _set(future)
    else:
        loop.call_soon_threadsafe(_set, future)


class Hooks:
    """The event hooks of one client's HTTP client: pace model requests by ``pacer``, report
    what their answers state. ``peers``: the processes of this machine sharing the key, counted
    again as requests go (``peers.py``)."""

    def __init__(
        self, pacer: pacing.Pacer, peers: Peers | None = None, *, asynchronous: bool
    ) -> None:
        self.pacer = pacer
        self.peers = peers
        if asynchronous:
            self.event_hooks: dict[str, list[Any]] = {
                "request": [self._before_async],
                "response": [self._after_async],
            }
        else:
            self.event_hooks = {"request": [self._before], "response": [self._after]}

    def _recount(self) -> None:
        """Count the processes calling the key again, when due, and share what they measured;
        a joining one holds."""
        if self.peers is None:
            return
        if (count := self.peers.poll(self.pacer.measured)) is not None:
            self.pacer.reshare(1 / count)
            self.pacer.pool(count, self.peers.shares)
            if self.peers.joined:
                self.pacer.hold(JOIN_SECONDS)

    def _ticket(self, request: Any) -> pacing.Ticket | None:
        if request.method != "POST" or not request.url.path.endswith(_PACED):
            return None
        self._recount()
        ticket = self.pacer.ask(pacing.cost(*estimate(request.content)), pacing.current())
        request.extensions[_TICKET] = ticket
        return ticket

    def _next_wait(self, ticket: pacing.Ticket, began: float) -> float:
        """Seconds ``ticket`` sleeps next (0: it goes now). A request that would wait past
        ``PATIENCE_SECONDS`` in all goes anyway. A process whose requests wait still calls
        the key: it counts again at least every ``INTERVAL_SECONDS``."""
        if self.peers is not None:
            self._recount()
        wait = self.pacer.wait(ticket)
        if wait > 0 and self.pacer.clock() - began + wait > pacing.PATIENCE_SECONDS:
            self.pacer.force(ticket)
            return 0.0
        return min(wait, INTERVAL_SECONDS) if self.peers is not None else wait

    def _before(self, request: Any) -> None:
        ticket = self._ticket(request)
        if ticket is None:
            return
        woken = threading.Event()
        ticket.wake = woken.set
        began = self.pacer.clock()
        waited = False
        while (wait := self._next_wait(ticket, began)) > 0:
            waited = True
            woken.wait(wait)
            woken.clear()  # the pacer changes its state before it wakes: it is asked next
        if waited:
            self._waited(ticket, began)

    async def _before_async(self, request: Any) -> None:
        ticket = self._ticket(request)
        if ticket is None:
            return
        loop = asyncio.get_running_loop()
        began = self.pacer.clock()
        waited = False
        try:
            while True:
                woken = loop.create_future()
                ticket.wake = functools.partial(_wake_future, loop, woken)
                if (wait := self._next_wait(ticket, began)) <= 0:
                    break
                waited = True
                timer = loop.call_later(wait, _set, woken)
                try:
                    await woken
                finally:
                    timer.cancel()
        except BaseException:
            self.pacer.cancel(ticket)  # cancelled while it waited: it leaves the queue
            raise
        if waited:
            self._waited(ticket, began)

    def _waited(self, ticket: pacing.Ticket, began: float) -> None:
        ended = self.pacer.clock()
        if ticket.record is not None:
            ticket.record.waited(began, ended)

    def _after(self, response: Any) -> None:
        ticket = response.request.extensions.pop(_TICKET, None)
        if ticket is not None:
            self.pacer.report(ticket, stated(response.headers), response.status_code == 429)

    async def _after_async(self, response: Any) -> None:
        self._after(response)
