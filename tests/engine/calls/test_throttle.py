"""Rate limits: a refused call waits on its own and is neither a failure nor an attempt, a shard
over a limit lowers its concurrency but not below ``min_concurrency``, and a quota that stays
spent stops the run.

Here through real runs of the engine on real checkpoints against in-process endpoints, what holds
under real threads and tasks whatever the machine's load, and what counts as a refusal. Where
concurrency settles is timing: ``test_throttle_policy.py`` checks it on a simulated endpoint."""

from __future__ import annotations

import asyncio
import datetime as dt
import random
import threading
import time
from dataclasses import dataclass, field
from email.utils import format_datetime
from typing import Any

import httpx
import openai
import polars as pl
import pytest
from helpers.rows import Storage, engine_settings, route, tickets

from checkpoint_assets import QuotaExhaustedError, RetryAfter
from checkpoint_assets.engine import Checkpoint, open_store, prepare, run
from checkpoint_assets.engine.calls.refusals import Throttled, retry_after_seconds, throttled
from checkpoint_assets.engine.settings import RunStats

ID = "ticket_id"


def _run(fn: Any, n: int, storage: Storage, **kw: Any) -> tuple[pl.DataFrame, RunStats]:
    s = engine_settings(**kw)
    checkpoint = Checkpoint(open_store(*storage), "job")
    return run(fn, prepare(tickets(n), s), checkpoint, s, job={"test": 1})


@pytest.fixture
def local(tmp_path: Any) -> Storage:
    return (str(tmp_path / "checkpoints"), {})


def _response(status: int, headers: dict[str, str] | None = None) -> httpx.Response:
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    return httpx.Response(status, headers=headers or {}, request=request)


def _httpx(status: int, retry_after: float | None) -> httpx.HTTPStatusError:
    headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
    response = _response(status, headers)
    return httpx.HTTPStatusError(str(status), request=response.request, response=response)


def _openai_429(retry_after: float | None) -> openai.RateLimitError:
    headers = {} if retry_after is None else {"retry-after-ms": str(int(retry_after * 1000))}
    return openai.RateLimitError("Rate limit reached", response=_response(429, headers), body=None)


def _overloaded_529(retry_after: float | None) -> openai.APIStatusError:
    # Anthropic answers 529 `overloaded_error` when its fleet is busy, whatever the client does.
    headers = {} if retry_after is None else {"retry-after": str(retry_after)}
    return openai.APIStatusError("Overloaded", response=_response(529, headers), body=None)


# -- real runs of the engine ---------------------------------------------------------------------
@dataclass
class Endpoint:
    """An in-process endpoint: admits ``admit`` calls at once, refuses the rest, and refuses
    ``refuse_first`` calls (or a seeded share ``p``) whatever the load; records every start."""

    admit: int = 10**9
    delay: float = 0.02
    error: Any = RetryAfter
    retry_after: float | None = 0.2
    refuse_first: int = 0
    p: float = 0.0
    seed: int = 0
    in_flight: int = 0
    peak: int = 0
    starts: list[float] = field(default_factory=list)
    refused_at: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def _enter(self) -> bool:
        with self.lock:
            now = time.monotonic()
            self.starts.append(now)
            refused = (
                self.refuse_first > 0 or self.in_flight >= self.admit or self.rng.random() < self.p
            )
            if refused:
                self.refuse_first -= 1
                self.refused_at.append(now)
            else:
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
            return not refused

    def _leave(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def __call__(self, batch: pl.DataFrame) -> pl.DataFrame:
        if not self._enter():
            raise self.error(self.retry_after)
        try:
            time.sleep(self.delay)
            return route(batch)
        finally:
            self._leave()

    async def call_async(self, batch: pl.DataFrame) -> pl.DataFrame:
        if not self._enter():
            raise self.error(self.retry_after)
        try:
            await asyncio.sleep(self.delay)
            return route(batch)
        finally:
            self._leave()


@pytest.mark.parametrize(
    "error",
    [RetryAfter, lambda s: _httpx(429, s), _openai_429, _overloaded_529],
    ids=["RetryAfter", "httpx-429-Retry-After", "openai-429-retry-after-ms", "529-overloaded"],
)
def test_a_refused_call_waits_its_retry_after_while_the_others_go_on(
    local: Storage, error: Any
) -> None:
    endpoint = Endpoint(delay=0.02, error=error, retry_after=0.3, refuse_first=1)

    result, stats = _run(
        endpoint, 60, local, batch_size=1, checkpoint_interval=8, max_concurrency=4, max_attempts=1
    )

    assert result.get_column("_error").null_count() == 60, "a refusal is not a failure"
    assert stats.failed_calls == 0 and stats.throttled_calls == 1 and stats.calls == 60
    assert stats.throttle_events == 0 and stats.throttled_seconds == 0
    assert stats.concurrency_final == 4
    (refused,) = endpoint.refused_at
    during = [t for t in endpoint.starts if refused < t < refused + 0.3]
    assert during, "the other calls went on while the refused one waited"
    assert endpoint.starts[-1] >= refused + 0.3, "the refused call came back after Retry-After"


def test_a_refusal_without_retry_after_backs_off_exponentially(local: Storage) -> None:
    endpoint = Endpoint(delay=0.0, error=lambda s: _httpx(503, None), refuse_first=3)

    result, _ = _run(endpoint, 4, local, max_attempts=1, retry_delay_seconds=0.05)

    assert result.get_column("_error").null_count() == 4
    gaps = [b - a for a, b in zip(endpoint.starts, endpoint.starts[1:], strict=False)][:3]
    assert gaps[0] >= 0.05 - 0.005 and gaps[1] >= 0.1 - 0.005 and gaps[2] >= 0.2 - 0.005


@pytest.mark.parametrize("is_async", [False, True], ids=["threads", "asyncio"])
def test_random_refusals_are_neither_failures_nor_attempts(local: Storage, is_async: bool) -> None:
    endpoint = Endpoint(delay=0.02, p=0.2, retry_after=0.02, seed=3)
    fn = endpoint.call_async if is_async else endpoint

    result, stats = _run(fn, 800, local, batch_size=1, checkpoint_interval=32, max_concurrency=16)

    assert result.get_column("_error").null_count() == 800
    assert stats.throttled_calls == len(endpoint.refused_at) > 100
    assert stats.failed_calls == 0 and stats.calls == 800


@pytest.mark.parametrize("is_async", [False, True], ids=["threads", "asyncio"])
def test_over_an_endpoints_limit_a_shard_lowers_its_concurrency_and_stores_every_row(
    local: Storage, is_async: bool
) -> None:
    endpoint = Endpoint(admit=8, delay=0.02, retry_after=0.02)
    fn = endpoint.call_async if is_async else endpoint

    result, stats = _run(fn, 1200, local, batch_size=1, checkpoint_interval=64, max_concurrency=64)

    assert result.get_column("_error").null_count() == 1200 and stats.failed_calls == 0
    assert stats.calls == 1200, "a refused call is not an attempt"
    assert stats.throttled_calls == len(endpoint.refused_at)
    assert stats.throttle_events >= 1


def test_min_concurrency_holds_against_an_endpoint_that_refuses(local: Storage) -> None:
    endpoint = Endpoint(admit=2, delay=0.01, retry_after=0.01)

    result, stats = _run(
        endpoint,
        300,
        local,
        batch_size=1,
        checkpoint_interval=32,
        max_concurrency=8,
        min_concurrency=6,
    )

    assert result.get_column("_error").null_count() == 300
    assert stats.concurrency_final >= 6


def test_a_quota_that_stays_spent_stops_the_run_with_what_is_done_checkpointed(
    local: Storage,
) -> None:
    calls = 0

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RetryAfter(0.1)
        return route(batch)

    with pytest.raises(QuotaExhaustedError) as raised:
        _run(fn, 40, local, checkpoint_interval=4, max_throttle_seconds=0.5)

    message = str(raised.value)
    assert "quota looks spent" in message and "max_throttle_seconds" in message
    assert "this run had finished 12 rows of its own (checkpointed)" in message

    _, again = _run(route, 40, local, checkpoint_interval=4)  # the quota is back
    assert again.rows_resumed == 12 and again.rows_computed == 28


# -- what counts as a refusal --------------------------------------------------------------------
def test_rate_limits_and_overload_answers_are_refusals_other_server_errors_are_not() -> None:
    assert throttled(_httpx(429, 1.0)) is not None
    assert throttled(_openai_429(None)) is not None
    for status in (503, 529):
        assert throttled(_httpx(status, None)) is not None, status
        assert throttled(_httpx(status, 2.0)) == Throttled(2.0, f"HTTP {status}")
    for status in (500, 502, 504):
        assert throttled(_httpx(status, None)) is None, f"{status} without Retry-After"
    assert throttled(_httpx(502, 3.0)) == Throttled(3.0, "HTTP 502"), "the server said when"
    assert throttled(ValueError("no")) is None
    try:
        try:
            raise _httpx(429, 2.0)
        except httpx.HTTPStatusError as e:
            raise RuntimeError("the model call failed") from e
    except RuntimeError as wrapped:
        seen = throttled(wrapped)
    assert seen is not None and seen.seconds == 2.0


def test_retry_after_headers_in_seconds_and_http_dates() -> None:
    assert retry_after_seconds({"retry-after": "2.5"}) == 2.5
    assert retry_after_seconds({"retry-after-ms": "150", "retry-after": "9"}) == 0.15
    now = time.time()
    date = format_datetime(dt.datetime.fromtimestamp(now + 30, tz=dt.UTC), usegmt=True)
    assert 28 <= (retry_after_seconds({"Retry-After": date}, now=now) or 0) <= 31
    assert retry_after_seconds({"retry-after": "soon"}) is None
    assert retry_after_seconds({}) is None
