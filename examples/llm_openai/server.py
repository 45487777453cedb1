"""A small chat server speaking the OpenAI and Anthropic APIs, for tests, benchmarks and offline
runs.

It answers ``POST /v1/chat/completions`` like the OpenAI API and ``POST /v1/messages`` like
Anthropic's Messages API, in the shapes the ``openai`` and ``anthropic`` clients parse, with the
support-ticket department the demo's keyword rules pick for the text of the last user message
(``billing``, ``technical``, ``account``, ``shipping``, ``sales`` or ``other``), so the same
prompt always gets the same answer. ``usage`` counts whitespace tokens (``prompt_tokens`` and
``completion_tokens``; ``input_tokens`` and ``output_tokens`` for Anthropic). It can also
misbehave the way real endpoints do, on both routes:

* ``latency_ms``: every answered request waits this long first (rate limits answer at once).
* ``rate_429``: that share of requests is refused with ``429`` and ``Retry-After`` (whole
  seconds, rounded up) plus ``retry-after-ms``, as OpenAI sends them.
* ``rate_500``: that share fails with ``500``.
* ``rate_drop``: that share has its connection closed without any answer.
* ``rate_529``: that share is refused with ``529``, Anthropic's ``overloaded_error``.
* ``max_in_flight``: a request arriving while that many are being answered gets ``429`` at once
  (admission control, like a provider's concurrency limit).
* ``requests_per_minute``, ``tokens_per_minute``: the key's budgets, enforced and stated in
  every answer's headers the way OpenAI and Anthropic do (``budget.py``); a request that does
  not fit gets ``429`` with the ``Retry-After`` after which it would.
* ``quota_requests``: once that many requests are answered, every request gets the API's
  spent-quota error: OpenAI's ``429`` ``insufficient_quota``, Anthropic's ``400`` spend limit.
* ``limit_schedule``: ``(seconds, limit)`` steps that change ``max_in_flight`` that many seconds
  after the first chat request, e.g. ``((4, 8), (10, 32))``: a provider lowering its limit for
  a while, at the same moments in every run.

Which request fails is decided by a hash of ``(seed, messages, attempt)``, where ``attempt``
counts the requests seen with the same messages, so a run is reproducible whatever order
concurrent requests arrive in, and a retried prompt eventually gets through.

``GET /stats`` returns what was served so far, by outcome (see :data:`OUTCOMES`), with the peak
number of requests in flight, the token counts and the server process's CPU time.
``GET /v1/models`` lists the one model.

Each API is a route of its own (``openai_api.py``, ``anthropic_api.py``) on one contract
(``answers.Api``); the behaviour and its options are in ``options.py``; running it (in a thread,
in a process) is ``examples/serving.py``'s, shared with the batch provider.

Start it from a shell (the first line printed is the OpenAI base URL; the Anthropic client takes
it without ``/v1``)::

    python -m examples.llm_openai.server --port 0 --latency-ms 50 --rate-429 0.05
    listening on http://127.0.0.1:PORT/v1

or in-process, on a free port, for tests::

    with serve(latency_ms=50, rate_429=0.05) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        claude = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused")
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from examples import serving
from examples.llm_openai.answers import DEFAULT_MODEL, Api, classify, count_tokens
from examples.llm_openai.anthropic_api import AnthropicMessages
from examples.llm_openai.budget import KeyBudget
from examples.llm_openai.openai_api import OpenAIChat
from examples.llm_openai.options import Settings, parse, settings_of

__all__ = [
    "DEFAULT_MODEL",
    "OUTCOMES",
    "ChatServer",
    "Settings",
    "classify",
    "serve",
    "serve_process",
    "stats",
]

#: The outcomes ``/stats`` counts: answered; refused by ``rate_429``; refused because
#: ``max_in_flight`` requests were in flight; failed by ``rate_500``; dropped by ``rate_drop``;
#: refused as malformed; refused as overloaded by ``rate_529``; refused by the key's budgets.
OUTCOMES: Final = (
    "ok",
    "rate_limited",
    "throttled",
    "server_error",
    "dropped",
    "bad_request",
    "overloaded",
    "over_budget",
    "quota_spent",
)


_DEFAULTS: Final = Settings()


class _Drop(Exception):
    """Raised by the handler to have the connection closed without an answer."""


# -- the server ---------------------------------------------------------------------------------
class ChatServer:
    """The ASGI application: the OpenAI and Anthropic routes plus ``/stats``, counting what it
    serves.

    All state is touched from the server's event loop only, so it needs no lock.
    """

    def __init__(self, settings: Settings, model: str = DEFAULT_MODEL) -> None:
        self.settings = settings
        self.model = model
        self.counts: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self._attempts: dict[bytes, int] = {}
        self._created = 0
        self._first: float | None = None  # when the first chat request arrived (monotonic)
        self.budget = KeyBudget(
            settings.requests_per_minute, settings.tokens_per_minute, settings.budget_window_seconds
        )
        openai_chat, anthropic_messages = OpenAIChat(), AnthropicMessages()
        self._router = Router(
            routes=[
                Route("/v1/chat/completions", self._route(openai_chat), methods=["POST"]),
                Route("/v1/messages", self._route(anthropic_messages), methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/stats", self._stats, methods=["GET"]),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> object:
        try:
            await self._router(scope, receive, send)
        except _Drop:
            # uvicorn closes the connection, without a response, when the application returns
            # something other than None before starting one: a dropped connection.
            return _Drop
        return None

    def snapshot(self) -> dict[str, int]:
        """What ``/stats`` returns: requests by outcome, the total, peak in flight, tokens.

        ``budget_tokens`` and ``budget_requests`` are what the key's budgets charged, over
        ``budget_ms`` from the first request charged to the last. ``cpu_ms`` is the CPU time of
        the server's whole process, for benchmarks.
        """
        return {
            **{outcome: self.counts[outcome] for outcome in OUTCOMES},
            "requests": sum(self.counts.values()),
            "peak_in_flight": self.peak_in_flight,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "budget_tokens": self.budget.charged_tokens,
            "budget_requests": self.budget.charged_requests,
            "budget_ms": round(self.budget.charged_seconds * 1000),
            "cpu_ms": round(time.process_time() * 1000),
        }

    async def _stats(self, request: Request) -> Response:
        return JSONResponse(self.snapshot())

    async def _models(self, request: Request) -> Response:
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "local"}
        return JSONResponse({"object": "list", "data": [model]})

    def _route(self, api: Api) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await self._admit(request, api)

        return endpoint

    async def _admit(self, request: Request, api: Api) -> Response:
        now = time.monotonic()
        if self._first is None:
            self._first = now
        limit = self.settings.limit_at(now - self._first)
        if limit is not None and self.in_flight >= limit:
            self.counts["throttled"] += 1
            return self._rate_limited(api, f"more than {limit} requests in flight")
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._answer(request, api)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: Request, api: Api) -> Response:
        try:
            asked = api.read(json.loads(await request.body()))
        except (ValueError, KeyError, TypeError):
            self.counts["bad_request"] += 1
            return api.error(400, api.bad_request)
        s = self.settings
        if s.quota_requests is not None and self.counts["ok"] >= s.quota_requests:
            self.counts["quota_spent"] += 1
            return api.quota_spent()
        text_bytes = sum(len(t.encode()) for t in asked.texts)
        wait = self.budget.charge(text_bytes, asked.max_tokens, time.monotonic())
        limits = api.limit_headers(self.budget, time.time()) if s.limit_headers else {}
        if wait > 0:
            self.counts["over_budget"] += 1
            return api.error(
                429,
                f"rate limit reached for tokens; retry after {wait:.3f} s",
                {
                    "retry-after": str(math.ceil(wait)),
                    "retry-after-ms": str(math.ceil(wait * 1000)),
                    **limits,
                },
            )
        fate = self._draw(asked.conversation)
        if fate < s.rate_429:
            self.counts["rate_limited"] += 1
            return self._rate_limited(api, "rate limit reached for requests")
        if s.latency_ms:
            await asyncio.sleep(s.latency_ms / 1000)
        if fate < s.rate_429 + s.rate_500:
            self.counts["server_error"] += 1
            return api.error(500, "the server had an error processing your request")
        if fate < s.rate_429 + s.rate_500 + s.rate_drop:
            self.counts["dropped"] += 1
            raise _Drop
        if fate < s.rate_429 + s.rate_500 + s.rate_drop + s.rate_529:
            self.counts["overloaded"] += 1
            return api.error(529, "Overloaded")
        answer = classify(asked.question)
        tokens = sum(count_tokens(t) for t in asked.texts), count_tokens(answer)
        self.counts["ok"] += 1
        self.prompt_tokens += tokens[0]
        self.completion_tokens += tokens[1]
        self._created += 1
        response = api.answer(asked, answer, tokens, self._created)
        response.headers.update(limits)
        return response

    def _draw(self, conversation: bytes) -> float:
        """A number in [0, 1) fixed by the seed, the messages and how often they were sent."""
        key = hashlib.blake2b(conversation, digest_size=16).digest()
        attempt = self._attempts.get(key, 0)
        self._attempts[key] = attempt + 1
        digest = hashlib.blake2b(
            b"%d\x00%d\x00" % (self.settings.seed, attempt) + key, digest_size=8
        ).digest()
        return int.from_bytes(digest, "big") / 2**64

    def _rate_limited(self, api: Api, why: str) -> Response:
        delay = self.settings.retry_after_seconds
        headers = {
            "retry-after": str(math.ceil(delay)),
            "retry-after-ms": str(round(delay * 1000)),
        }
        return api.error(429, f"{why}; retry after {delay:g} s", headers)


# -- running it (examples/serving.py) -----------------------------------------------------------
@contextmanager
def serve(
    *,
    latency_ms: float = 0.0,
    rate_429: float = 0.0,
    rate_500: float = 0.0,
    rate_drop: float = 0.0,
    rate_529: float = 0.0,
    retry_after_seconds: float = 1.0,
    max_in_flight: int | None = None,
    limit_schedule: tuple[tuple[float, int], ...] = (),
    seed: int = 0,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    budget_window_seconds: float = 60.0,
    limit_headers: bool = True,
    quota_requests: int | None = None,
    model: str = DEFAULT_MODEL,
) -> Iterator[str]:
    """Run the server in a thread of this process on a free port; yield its base URL.

    The base URL ends in ``/v1``, as ``openai.OpenAI(base_url=...)`` expects. The server stops,
    and its port is released, when the block exits.

    >>> with serve(latency_ms=5) as base_url:
    ...     stats(base_url)["requests"]
    0
    """
    settings = Settings(
        latency_ms=latency_ms,
        rate_429=rate_429,
        rate_500=rate_500,
        rate_drop=rate_drop,
        rate_529=rate_529,
        retry_after_seconds=retry_after_seconds,
        max_in_flight=max_in_flight,
        limit_schedule=limit_schedule,
        seed=seed,
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        budget_window_seconds=budget_window_seconds,
        limit_headers=limit_headers,
        quota_requests=quota_requests,
    )
    with serving.in_thread(ChatServer(settings, model), "chat server") as url:
        yield url


@contextmanager
def serve_process(settings: Settings = _DEFAULTS, *, model: str = DEFAULT_MODEL) -> Iterator[str]:
    """Run the server as a separate process on a free port; yield its base URL.

    The server's work then runs on its own interpreter, not on this process's: what a benchmark
    of the client wants. The process is stopped with SIGTERM when the block exits.
    """
    args = [*settings.argv(), "--model", model]
    with serving.in_process("examples.llm_openai.server", args, "server") as url:
        yield url


def stats(base_url: str) -> dict[str, int]:
    """The server's ``/stats``: requests served so far by outcome, peak in flight, tokens, CPU."""
    return serving.stats(base_url)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        settings = settings_of(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serving.run(ChatServer(settings, args.model), args.port, args.log_level)


if __name__ == "__main__":
    sys.exit(main())
