"""How the chat server misbehaves (``Settings``, see ``server.py``), and the same as its
command-line options."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from examples.llm_openai.answers import DEFAULT_MODEL


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
        limit_schedule: ``(seconds, limit)`` steps, in time order: from ``seconds`` after the
            first chat request on, ``limit`` replaces ``max_in_flight``.
        seed: changes which requests fail, not how many.
        requests_per_minute: the key's requests budget (``budget.py``); None: no limit.
        tokens_per_minute: the key's tokens budget; None: no limit.
        budget_window_seconds: the window the budgets refill over (OpenAI's is a minute;
            shorter makes tests quick): a full budget is a window's worth.
        limit_headers: state the budgets in every answer's headers (False: enforce them
            silently, as a proxy in front of a server may).
        quota_requests: after this many answered requests, refuse every request with the API's
            spent-quota error (OpenAI's ``insufficient_quota`` 429, Anthropic's spend limit
            400); None: no quota.
    """

    latency_ms: float = 0.0
    rate_429: float = 0.0
    rate_500: float = 0.0
    rate_drop: float = 0.0
    rate_529: float = 0.0
    retry_after_seconds: float = 1.0
    max_in_flight: int | None = None
    limit_schedule: tuple[tuple[float, int], ...] = ()
    seed: int = 0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    budget_window_seconds: float = 60.0
    limit_headers: bool = True
    quota_requests: int | None = None

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
        if self.quota_requests is not None:
            argv += ["--quota-requests", str(self.quota_requests)]
        for option, value in (
            ("--requests-per-minute", self.requests_per_minute),
            ("--tokens-per-minute", self.tokens_per_minute),
        ):
            if value is not None:
                argv += [option, str(value)]
        argv += ["--budget-window", str(self.budget_window_seconds)]
        if not self.limit_headers:
            argv.append("--no-limit-headers")
        if self.limit_schedule:
            steps = ",".join(f"{at:g}:{limit}" for at, limit in self.limit_schedule)
            argv += ["--limit-schedule", steps]
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
        times = [at for at, _ in self.limit_schedule]
        if times != sorted(times) or any(at < 0 for at in times):
            raise ValueError(f"limit_schedule must be in time order from 0 on, got {times}")
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.budget_window_seconds <= 0:
            raise ValueError(f"budget_window_seconds must be > 0, got {self.budget_window_seconds}")
        if any(limit < 1 for _, limit in self.limit_schedule):
            raise ValueError(f"limit_schedule limits must be >= 1, got {self.limit_schedule}")

    def limit_at(self, seconds: float) -> int | None:
        """The admission limit ``seconds`` after the first chat request."""
        limit = self.max_in_flight
        for at, step in self.limit_schedule:
            if seconds >= at:
                limit = step
        return limit


def parse(argv: list[str] | None) -> argparse.Namespace:
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
    p.add_argument(
        "--limit-schedule",
        type=_schedule,
        default=(),
        help="change --max-in-flight over time: SECONDS:LIMIT,... after the first chat request",
    )
    p.add_argument("--seed", type=int, default=0, help="which requests fail (default 0)")
    p.add_argument("--requests-per-minute", type=int, help="the key's requests budget")
    p.add_argument("--tokens-per-minute", type=int, help="the key's tokens budget")
    p.add_argument(
        "--budget-window", type=float, default=60.0, help="seconds the budgets refill over"
    )
    p.add_argument(
        "--no-limit-headers",
        dest="limit_headers",
        action="store_false",
        help="enforce the budgets without stating them in headers",
    )
    p.add_argument("--quota-requests", type=int, help="answer this many, then the quota is spent")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name (default {DEFAULT_MODEL})")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    return p.parse_args(argv)


def _schedule(text: str) -> tuple[tuple[float, int], ...]:
    """``"4:8,10:32"`` as ``((4.0, 8), (10.0, 32))``."""
    try:
        return tuple(
            (float(at), int(limit)) for at, limit in (s.split(":") for s in text.split(","))
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected SECONDS:LIMIT pairs separated by commas, like 4:8,10:32; got {text!r}"
        ) from None


def settings_of(args: argparse.Namespace) -> Settings:
    """The ``Settings`` that parsed options give (ValueError when one is out of range)."""
    return Settings(
        latency_ms=args.latency_ms,
        rate_429=args.rate_429,
        rate_500=args.rate_500,
        rate_drop=args.rate_drop,
        rate_529=args.rate_529,
        retry_after_seconds=args.retry_after,
        quota_requests=args.quota_requests,
        max_in_flight=args.max_in_flight,
        limit_schedule=args.limit_schedule,
        seed=args.seed,
        requests_per_minute=args.requests_per_minute,
        tokens_per_minute=args.tokens_per_minute,
        budget_window_seconds=args.budget_window,
        limit_headers=args.limit_headers,
    )
