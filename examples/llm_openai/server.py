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

Which request fails is decided by a hash of ``(seed, messages, attempt)``, where ``attempt``
counts the requests seen with the same messages, so a run is reproducible whatever order
concurrent requests arrive in, and a retried prompt eventually gets through.

``GET /stats`` returns what was served so far, by outcome (see :data:`OUTCOMES`), with the peak
number of requests in flight, the token counts and the server process's CPU time.
``GET /v1/models`` lists the one model.

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

import argparse
import asyncio
import hashlib
import json
import logging
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Final, Protocol

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from examples.ticket_routing.model import DEPARTMENT_RULES

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

DEFAULT_MODEL: Final = "ticket-router-1"
#: The outcomes ``/stats`` counts: answered; refused by ``rate_429``; refused because
#: ``max_in_flight`` requests were in flight; failed by ``rate_500``; dropped by ``rate_drop``;
#: refused as malformed; refused as overloaded by ``rate_529``.
OUTCOMES: Final = (
    "ok",
    "rate_limited",
    "throttled",
    "server_error",
    "dropped",
    "bad_request",
    "overloaded",
)

_RULES: Final = [
    (name, re.compile(strong, re.ASCII), re.compile(weak, re.ASCII))
    for name, (strong, weak) in DEPARTMENT_RULES.items()
]


def classify(text: str) -> str:
    """The department the demo's keyword rules pick for ``text``.

    Two points per strong keyword, one per weak one; the highest score wins, ties go to the
    department listed first, and text with no keyword goes to ``other``: the same rules as the
    demo's ``FakeRouter``.

    >>> classify("I was charged twice, please refund me")
    'billing'
    """
    lowered = text.lower()
    best, top = "other", 0
    for name, strong, weak in _RULES:
        score = 2 * len(strong.findall(lowered)) + len(weak.findall(lowered))
        if score > top:
            best, top = name, score
    return best


@dataclass(frozen=True)
class Settings:
    """How the server behaves; see the module docstring.

    Attributes:
        latency_ms: milliseconds every answered request waits before its answer.
        rate_429: share of requests refused with ``429`` and a retry delay.
        rate_500: share of requests failing with ``500``.
        rate_drop: share of requests whose connection is closed without an answer.
        rate_529: share of requests refused with ``529`` overloaded (Anthropic's
            ``overloaded_error``; the OpenAI route sends the same status).
        retry_after_seconds: the delay a ``429`` asks for.
        max_in_flight: answer ``429`` at once to a request arriving while this many are in
            flight; ``None`` admits every request.
        seed: changes which requests fail, not how many.
    """

    latency_ms: float = 0.0
    rate_429: float = 0.0
    rate_500: float = 0.0
    rate_drop: float = 0.0
    rate_529: float = 0.0
    retry_after_seconds: float = 1.0
    max_in_flight: int | None = None
    seed: int = 0

    def argv(self) -> list[str]:
        """These settings as options of ``python -m examples.llm_openai.server``."""
        argv = [
            *("--latency-ms", str(self.latency_ms)),
            *("--rate-429", str(self.rate_429)),
            *("--rate-500", str(self.rate_500)),
            *("--rate-drop", str(self.rate_drop)),
            *("--rate-529", str(self.rate_529)),
            *("--retry-after", str(self.retry_after_seconds)),
            *("--seed", str(self.seed)),
        ]
        if self.max_in_flight is not None:
            argv += ["--max-in-flight", str(self.max_in_flight)]
        return argv

    def __post_init__(self) -> None:
        rates = {
            "rate_429": self.rate_429,
            "rate_500": self.rate_500,
            "rate_drop": self.rate_drop,
            "rate_529": self.rate_529,
        }
        for name, rate in rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {rate}")
        if sum(rates.values()) > 1.0:
            raise ValueError(f"{' + '.join(rates)} must be at most 1, got {sum(rates.values())}")
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms}")
        if self.retry_after_seconds < 0:
            raise ValueError(f"retry_after_seconds must be >= 0, got {self.retry_after_seconds}")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1 or None, got {self.max_in_flight}")


_DEFAULTS: Final = Settings()
#: The folder holding the ``examples`` package, where ``python -m examples...`` starts.
_REPO: Final = str(Path(__file__).resolve().parents[2])


class _Drop(Exception):
    """Raised by the handler to have the connection closed without an answer."""


def _tokens(text: str) -> int:
    return len(text.split())


@dataclass(frozen=True)
class _Asked:
    """A request, read the same way whichever API it came through."""

    model: str
    texts: list[str]  # every message's text, the system prompt included
    question: str  # the text classified: the last user message
    conversation: bytes  # what decides the request's fate (see ``ChatServer._draw``)


class _Api(Protocol):
    """How one API reads a request and writes its answers and errors."""

    bad_request: str

    def read(self, body: Any) -> _Asked:
        """The request, or ValueError / KeyError / TypeError when it is malformed."""

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        """An error response in the API's shape, which its client turns into an exception."""

    def answer(self, asked: _Asked, answer: str, tokens: tuple[int, int], number: int) -> Response:
        """The answer, with ``tokens`` = (prompt, completion) as the API's usage."""


class _OpenAIChat:
    """``POST /v1/chat/completions`` of the OpenAI API."""

    bad_request = (
        "expected a JSON body with 'model' and a non-empty list of 'messages', "
        "each with a string 'content'"
    )
    _KINDS: Final = {
        400: ("invalid_request_error", None),
        429: ("requests", "rate_limit_exceeded"),
        500: ("server_error", None),
        529: ("server_error", "overloaded"),
    }

    def read(self, body: Any) -> _Asked:
        model = body["model"]
        messages = body["messages"]
        texts = [m["content"] for m in messages]
        if not (isinstance(model, str) and texts and all(isinstance(t, str) for t in texts)):
            raise TypeError
        user = [m["content"] for m in messages if m.get("role") == "user"]
        conversation = json.dumps(messages, sort_keys=True).encode()
        return _Asked(model, texts, user[-1] if user else texts[-1], conversation)

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        kind, code = self._KINDS[status]
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
        return JSONResponse(body, status_code=status, headers=headers)

    def answer(self, asked: _Asked, answer: str, tokens: tuple[int, int], number: int) -> Response:
        prompt_tokens, completion_tokens = tokens
        return JSONResponse(
            {
                "id": f"chatcmpl-{number}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": asked.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": answer},
                        "finish_reason": "stop",
                        "logprobs": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )


# -- Anthropic's Messages API (POST /v1/messages) ----------------------------------------------
class _AnthropicMessages:
    """``POST /v1/messages`` of Anthropic's API, in the shapes the ``anthropic`` client parses.

    ``system`` and each message's ``content`` may be a string or a list of text blocks. Errors
    carry Anthropic's types: ``rate_limit_error`` (429), ``api_error`` (500) and
    ``overloaded_error`` (529), which the client raises as ``RateLimitError``,
    ``InternalServerError`` and ``OverloadedError``.
    """

    bad_request = (
        "expected a JSON body with 'model', a positive integer 'max_tokens' and a non-empty "
        "list of 'messages', each with a 'role' (user or assistant) and a 'content' that is a "
        "string or a list of text blocks"
    )
    _KINDS: Final = {
        400: "invalid_request_error",
        429: "rate_limit_error",
        500: "api_error",
        529: "overloaded_error",
    }

    def read(self, body: Any) -> _Asked:
        model, messages, max_tokens = body["model"], body["messages"], body["max_tokens"]
        if not (isinstance(model, str) and isinstance(max_tokens, int) and max_tokens > 0):
            raise TypeError
        if not messages or any(m["role"] not in ("user", "assistant") for m in messages):
            raise ValueError
        texts = [_block_text(m["content"]) for m in messages]
        user = [t for m, t in zip(messages, texts, strict=True) if m["role"] == "user"]
        system = body.get("system")
        if system is not None:
            texts.insert(0, _block_text(system))
        conversation = json.dumps({"system": system, "messages": messages}, sort_keys=True)
        return _Asked(model, texts, user[-1] if user else texts[-1], conversation.encode())

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        body = {"type": "error", "error": {"type": self._KINDS[status], "message": message}}
        return JSONResponse(body, status_code=status, headers=headers)

    def answer(self, asked: _Asked, answer: str, tokens: tuple[int, int], number: int) -> Response:
        input_tokens, output_tokens = tokens
        return JSONResponse(
            {
                "id": f"msg_{number:024d}",
                "type": "message",
                "role": "assistant",
                "model": asked.model,
                "content": [{"type": "text", "text": answer}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
            }
        )


def _block_text(content: Any) -> str:
    """The text of a string or of a list of Anthropic content blocks (text blocks only)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        for b in content
    ):
        return "\n".join(b["text"] for b in content)
    raise TypeError


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
        openai_chat, anthropic_messages = _OpenAIChat(), _AnthropicMessages()
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

        ``cpu_ms`` is the CPU time of the server's whole process, for benchmarks.
        """
        return {
            **{outcome: self.counts[outcome] for outcome in OUTCOMES},
            "requests": sum(self.counts.values()),
            "peak_in_flight": self.peak_in_flight,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cpu_ms": round(time.process_time() * 1000),
        }

    async def _stats(self, request: Request) -> Response:
        return JSONResponse(self.snapshot())

    async def _models(self, request: Request) -> Response:
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "local"}
        return JSONResponse({"object": "list", "data": [model]})

    def _route(self, api: _Api) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await self._admit(request, api)

        return endpoint

    async def _admit(self, request: Request, api: _Api) -> Response:
        limit = self.settings.max_in_flight
        if limit is not None and self.in_flight >= limit:
            self.counts["throttled"] += 1
            return self._rate_limited(api, f"more than {limit} requests in flight")
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._answer(request, api)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: Request, api: _Api) -> Response:
        try:
            asked = api.read(json.loads(await request.body()))
        except (ValueError, KeyError, TypeError):
            self.counts["bad_request"] += 1
            return api.error(400, api.bad_request)
        fate = self._draw(asked.conversation)
        s = self.settings
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
        tokens = sum(_tokens(t) for t in asked.texts), _tokens(answer)
        self.counts["ok"] += 1
        self.prompt_tokens += tokens[0]
        self.completion_tokens += tokens[1]
        self._created += 1
        return api.answer(asked, answer, tokens, self._created)

    def _draw(self, conversation: bytes) -> float:
        """A number in [0, 1) fixed by the seed, the messages and how often they were sent."""
        key = hashlib.blake2b(conversation, digest_size=16).digest()
        attempt = self._attempts.get(key, 0)
        self._attempts[key] = attempt + 1
        digest = hashlib.blake2b(
            b"%d\x00%d\x00" % (self.settings.seed, attempt) + key, digest_size=8
        ).digest()
        return int.from_bytes(digest, "big") / 2**64

    def _rate_limited(self, api: _Api, why: str) -> Response:
        delay = self.settings.retry_after_seconds
        headers = {
            "retry-after": str(math.ceil(delay)),
            "retry-after-ms": str(round(delay * 1000)),
        }
        return api.error(429, f"{why}; retry after {delay:g} s", headers)


class _QuietDrops(logging.Filter):
    """Hide uvicorn's complaint about the application's deliberate dropped connections."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("ASGI callable should return None")


_QUIET_DROPS: Final = _QuietDrops()


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)
    return sock


def _server(app: ChatServer, log_level: str, own_logging: bool) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``own_logging`` lets uvicorn configure logging."""
    config = uvicorn.Config(
        app,
        interface="asgi3",
        lifespan="off",
        access_log=False,
        proxy_headers=False,
        log_level=log_level,
        log_config=uvicorn.config.LOGGING_CONFIG if own_logging else None,
        backlog=2048,
        # Longer than a client's pause between calls (uvicorn's default is 5 s), so an idle
        # pooled connection is not closed just as the client reuses it: no spurious drops.
        timeout_keep_alive=120,
        timeout_graceful_shutdown=5,
    )
    logging.getLogger("uvicorn.error").addFilter(_QUIET_DROPS)
    return uvicorn.Server(config)


def _base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}/v1"


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
    seed: int = 0,
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
        seed=seed,
    )
    sock = _listen(0)
    server = _server(ChatServer(settings, model), log_level="warning", own_logging=False)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="openai-server", daemon=True
    )
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the chat server failed to start; see its log")
            time.sleep(0.01)
        yield _base_url(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextmanager
def serve_process(settings: Settings = _DEFAULTS, *, model: str = DEFAULT_MODEL) -> Iterator[str]:
    """Run the server as a separate process on a free port; yield its base URL.

    The server's work then runs on its own interpreter, not on this process's: what a benchmark
    of the client wants. The process is stopped with SIGTERM when the block exits.
    """
    argv = [sys.executable, "-m", "examples.llm_openai.server", "--port", "0", *settings.argv()]
    process = subprocess.Popen(
        [*argv, "--model", model], stdout=subprocess.PIPE, text=True, cwd=_REPO
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        if not first.startswith("listening on "):
            raise RuntimeError(f"the server process did not start (it printed {first!r})")
        yield first.removeprefix("listening on ").strip()
    finally:
        process.terminate()
        process.wait(timeout=15)


def stats(base_url: str) -> dict[str, int]:
    """The server's ``/stats``: requests served so far by outcome, peak in flight, tokens, CPU."""
    url = base_url.removesuffix("/").removesuffix("/v1") + "/stats"
    with urllib.request.urlopen(url, timeout=10) as response:
        result: dict[str, int] = json.load(response)
    return result


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m examples.llm_openai.server",
        description="A deterministic chat server on 127.0.0.1 speaking the OpenAI "
        "(/v1/chat/completions) and Anthropic (/v1/messages) APIs. "
        "The first line printed is its base URL.",
    )
    p.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (default)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="wait before each answer")
    p.add_argument("--rate-429", type=float, default=0.0, help="share of requests refused")
    p.add_argument("--retry-after", type=float, default=1.0, help="seconds a 429 asks to wait")
    p.add_argument("--rate-500", type=float, default=0.0, help="share of requests failing")
    p.add_argument("--rate-drop", type=float, default=0.0, help="share of connections dropped")
    p.add_argument("--rate-529", type=float, default=0.0, help="share refused as overloaded")
    p.add_argument("--max-in-flight", type=int, help="refuse requests beyond this many in flight")
    p.add_argument("--seed", type=int, default=0, help="which requests fail (default 0)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name (default {DEFAULT_MODEL})")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    return p.parse_args(argv)


def _stop(signum: int, frame: FrameType | None) -> Any:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        settings = Settings(
            latency_ms=args.latency_ms,
            rate_429=args.rate_429,
            rate_500=args.rate_500,
            rate_drop=args.rate_drop,
            rate_529=args.rate_529,
            retry_after_seconds=args.retry_after,
            max_in_flight=args.max_in_flight,
            seed=args.seed,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        sock = _listen(args.port)
    except OSError as e:
        print(f"error: cannot listen on 127.0.0.1:{args.port}: {e}", file=sys.stderr)
        return 1
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal: exit with 0.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"listening on {_base_url(sock)}", flush=True)
    server = _server(ChatServer(settings, args.model), args.log_level, own_logging=True)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
