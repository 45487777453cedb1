"""Pacing by the limits an endpoint states, through the real ``openai`` and ``anthropic`` clients
against the local chat server enforcing a key's budget (``examples/llm_openai/budget.py``), and
two shards in two processes sharing that key.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib.util
import itertools
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

if not all(importlib.util.find_spec(p) for p in ("openai", "anthropic")):  # extras; CI has them
    if os.environ.get("CI") == "true":
        pytest.fail("openai or anthropic is not installed: pip install -e '.[dev]'", pytrace=False)
    pytest.skip(
        "openai or anthropic is not installed: pip install -e '.[dev]'", allow_module_level=True
    )

import dagster as dg
import httpx

from checkpoint_assets import AnthropicResource, OpenAIResource
from checkpoint_assets.engine.calls.pacing import Limit, Pacer
from checkpoint_assets.engine.calls.shares import SHARE_PAIRS, Bucket
from checkpoint_assets.resources import peers
from checkpoint_assets.resources.rate_limits import Hooks, duration_seconds, estimate, stated
from examples.llm_openai.server import Settings, serve, serve_process, stats

ROOT = Path(__file__).resolve().parents[2]
MODULE = "examples.llm_openai.definitions"
ASSET = "ticket_department"


# -- what the headers say -------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, seconds",
    [("6m0s", 360.0), ("1.5s", 1.5), ("20ms", 0.02), ("1h2m3s", 3723.0), ("0s", 0.0), ("7", 7.0)],
)
def test_openai_reset_durations_are_read_in_seconds(text: str, seconds: float) -> None:
    assert duration_seconds(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "soon", "6m0", "1.5 s", "-2x"])
def test_a_reset_that_is_no_duration_is_none(text: str) -> None:
    assert duration_seconds(text) is None


def test_openai_headers_state_the_requests_and_tokens_budgets() -> None:
    headers = {
        "x-ratelimit-limit-requests": "10000",
        "x-ratelimit-remaining-requests": "9990",
        "x-ratelimit-reset-requests": "60ms",
        "x-ratelimit-limit-tokens": "2000000",
        "x-ratelimit-remaining-tokens": "1000000",
        "x-ratelimit-reset-tokens": "6m0s",
    }

    assert stated(headers) == {
        "requests": Limit(10000, 9990, 0.06),
        "tokens": Limit(2000000, 1000000, 360.0),
    }


def test_anthropic_headers_state_four_budgets_with_rfc3339_resets() -> None:
    now = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC).timestamp()
    headers = {}
    for name, remaining, reset in [
        ("requests", 49, "2026-01-01T12:00:01.5Z"),
        ("tokens", 1000, "2026-01-01T12:00:30Z"),
        ("input-tokens", 800, "2026-01-01T12:00:30+00:00"),
        ("output-tokens", 200, "2026-01-01T12:01:00Z"),
    ]:
        headers[f"anthropic-ratelimit-{name}-limit"] = "2000"
        headers[f"anthropic-ratelimit-{name}-remaining"] = str(remaining)
        headers[f"anthropic-ratelimit-{name}-reset"] = reset

    assert stated(headers, now=now) == {
        "requests": Limit(2000, 49, 1.5),
        "tokens": Limit(2000, 1000, 30.0),
        "input_tokens": Limit(2000, 800, 30.0),
        "output_tokens": Limit(2000, 200, 60.0),
    }


@pytest.mark.parametrize(
    "headers",
    [
        {"RateLimit": '"default";r=50;t=30', "RateLimit-Policy": '"default";q=100;w=60'},
        {"RateLimit": "limit=100, remaining=50, reset=30"},
        {"RateLimit-Limit": "100", "RateLimit-Remaining": "50", "RateLimit-Reset": "30"},
    ],
    ids=["current-draft", "combined-field", "separate-fields"],
)
def test_the_ietf_fields_state_a_requests_window(headers: dict[str, str]) -> None:
    lowered = {k.lower(): v for k, v in headers.items()}  # as httpx's headers look them up

    assert stated(lowered) == {"requests": Limit(100, 50, 30.0, steady=False)}


def test_an_answer_without_limits_states_nothing() -> None:
    assert stated({"content-type": "application/json", "x-ratelimit-limit-tokens": "lots"}) == {}


def test_a_request_costs_its_text_over_four_and_its_output_limit() -> None:
    openai_body = b'{"model":"m","messages":[{"role":"system","content":"abcd"},'
    openai_body += b'{"role":"user","content":[{"type":"text","text":"abcdefgh"}]}],"max_tokens":5}'
    anthropic_body = b'{"model":"m","system":"abcd","max_tokens":7,'
    anthropic_body += b'"messages":[{"role":"user","content":"\xc3\xa9\xc3\xa9"}]}'

    assert estimate(openai_body) == (3.0, 5.0)
    assert estimate(anthropic_body) == (2.0, 7.0)
    assert estimate(b"not json!") == (2.25, 0.0)


# -- the hooks: a request waits for budget, and goes once it is started ----------------------
def _chat_request(tokens: int) -> httpx.Request:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 4 * tokens}]}
    return httpx.Request("POST", "http://endpoint.test/v1/chat/completions", json=body)


def _answer(request: httpx.Request, remaining: int) -> httpx.Response:
    # A key of 600 tokens a minute, which is full again in a minute when nothing is left.
    reset = f"{(600 - remaining) / 10:g}s"
    headers = {
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": str(remaining),
        "x-ratelimit-reset-tokens": reset,
    }
    return httpx.Response(200, headers=headers, request=request)


def test_requests_started_while_their_waiters_sleep_are_sent_at_once() -> None:
    # The pacer's clock stands still: no wait ever ends by itself. An answer stating the key
    # full again starts the three waiting requests; each must then go at once. A waiter that
    # kept sleeping its estimate (10 to 30 s here) would hold a request counted as drawn.
    pacer = Pacer(clock=lambda: 0.0)
    hooks = Hooks(pacer, asynchronous=True)

    async def run() -> list[bool]:
        first, second = _chat_request(600), _chat_request(0)
        await hooks._before_async(first)
        await hooks._before_async(second)
        await hooks._after_async(_answer(first, remaining=0))  # the key is spent
        held = [asyncio.create_task(hooks._before_async(_chat_request(100))) for _ in range(3)]
        await asyncio.sleep(0)
        assert not any(t.done() for t in held)

        await hooks._after_async(_answer(second, remaining=600))
        for _ in range(10):  # a few turns of the loop, no time
            await asyncio.sleep(0)
        done = [t.done() for t in held]
        for task in held:
            task.cancel()
        return done

    assert asyncio.run(run()) == [True, True, True]


# -- processes that share assumed limits count each other ----------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_processes_calling_a_key_count_each_other_as_they_start_and_finish(
    tmp_path: Path,
) -> None:
    clock = _Clock()
    directory = peers.directory_of("http://endpoint.test/v1\nkey", tmp_path)
    first = peers.Peers(directory, "first", clock)
    second = peers.Peers(directory, "second", clock)
    assert first.poll() == 1
    assert second.poll() == 2
    assert first.poll() is None  # not due yet
    clock.now += peers.FIRST_INTERVAL_SECONDS
    assert first.poll() == 2

    second.leave()  # it finished
    clock.now += peers.FIRST_INTERVAL_SECONDS
    assert first.poll() == 1
    assert directory.parent == tmp_path and "key" not in directory.name  # a digest


def test_each_process_reads_the_shares_the_others_measured(tmp_path: Path) -> None:
    clock = _Clock()
    directory = tmp_path / "key"
    first, second = peers.Peers(directory, "first", clock), peers.Peers(directory, "second", clock)
    first.poll(lambda: {"tokens": 0.7, "requests": 0.6})
    assert second.poll(lambda: {"tokens": 0.25}) == 2

    assert sorted(second.shares["tokens"]) == [0.25, 0.7]
    assert second.shares["requests"] == [0.6]
    assert sorted(p.name for p in directory.iterdir()) == ["first", "second"]  # none left aside


def test_the_threads_of_one_process_poll_its_file_without_racing(tmp_path: Path) -> None:
    # The sync client's threads all count peers through one Peers; each poll is due.
    ticks = itertools.count()
    counted = peers.Peers(tmp_path / "key", "threads", lambda: float(next(ticks)))
    errors: list[BaseException] = []

    def poll() -> None:
        try:
            for _ in range(300):
                counted.poll(lambda: {"tokens": 0.5})
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=poll) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert [p.name for p in (tmp_path / "key").iterdir()] == ["threads"]
    assert counted.shares == {"tokens": [0.5]}


def test_shards_on_one_key_take_the_mean_of_what_they_measured(tmp_path: Path) -> None:
    # Two shards measured 0.7 and 0.25 of the key's draw: each takes 0.475, and the key's
    # refill between them stays 0.95 of its rate.
    clock = _Clock()
    directory = tmp_path / "key"
    pacers = [Pacer(clock), Pacer(clock)]
    for pacer, drew_before in zip(pacers, [0.7, 0.25], strict=True):
        bucket = pacer._buckets["tokens"] = Bucket(Limit(600, 600, 1.0), clock.now)
        bucket.stated, bucket.pairs, bucket.measured = True, SHARE_PAIRS, drew_before
    names = ("a", "b")
    hooks = [
        Hooks(pacer, peers.Peers(directory, name, clock), asynchronous=False)
        for pacer, name in zip(pacers, names, strict=True)
    ]
    for _ in range(2):  # each writes its share, then reads the other's
        for hook in hooks:
            hook._ticket(_chat_request(1))
        clock.now += peers.FIRST_INTERVAL_SECONDS

    assert [p.share("tokens") for p in pacers] == [pytest.approx(0.475)] * 2


def test_a_killed_process_stops_counting_and_its_file_goes_later(tmp_path: Path) -> None:
    clock = _Clock()
    directory = tmp_path / "key"
    alive, killed = peers.Peers(directory, "alive", clock), peers.Peers(directory, "killed", clock)
    killed.poll()
    assert alive.poll() == 2

    clock.now += peers.LIVE_SECONDS + peers.FIRST_SECONDS  # the killed one touches it no more
    assert alive.poll() == 1
    assert (directory / "killed").exists()
    clock.now += peers.FORGET_SECONDS
    alive.poll()
    assert not (directory / "killed").exists()


def test_a_shard_takes_a_larger_share_of_assumed_limits_when_others_finish(
    tmp_path: Path,
) -> None:
    clock = _Clock()
    directory = tmp_path / "key"
    other = peers.Peers(directory, "other", clock)
    other.poll()
    pacer = Pacer(clock)
    pacer.assume({"tokens": 6_000})
    hooks = Hooks(pacer, peers.Peers(directory, "this", clock), asynchronous=False)
    hooks._ticket(_chat_request(1))
    assert pacer.share("tokens") == 0.5

    other.leave()
    clock.now += peers.FIRST_INTERVAL_SECONDS
    hooks._ticket(_chat_request(1))
    assert pacer.share("tokens") == 1.0


def test_a_shard_that_joins_others_sends_nothing_until_they_counted_it(tmp_path: Path) -> None:
    clock = _Clock()
    directory = tmp_path / "key"
    other = peers.Peers(directory, "other", clock)
    other.poll()
    pacer = Pacer(clock)
    pacer.assume({"tokens": 6_000})  # 100 a second for the key
    hooks = Hooks(pacer, peers.Peers(directory, "this", clock), asynchronous=False)
    ticket = hooks._ticket(_chat_request(1))
    assert ticket is not None
    # Half of the key, 50 tokens a second: its one token after the join's wait.
    assert pacer.wait(ticket) == pytest.approx(peers.JOIN_SECONDS + 1 / 50)

    peers.Peers(directory, "third", clock).poll()  # another joins before this one sent
    clock.now += peers.FIRST_INTERVAL_SECONDS
    hooks._ticket(_chat_request(1))
    assert pacer.share("tokens") == pytest.approx(1 / 3)
    # The join's wait lasts as long at the smaller share; the token takes longer.
    wait = peers.JOIN_SECONDS - peers.FIRST_INTERVAL_SECONDS + 1 / (100 / 3)
    assert pacer.wait(ticket) == pytest.approx(wait)


# -- through the real clients ---------------------------------------------------------------
def endpoint(kind: str, base_url: str, **settings: Any) -> OpenAIResource | AnthropicResource:
    # A key of its own: a process keeps one pacer per key, and a test's servers may reuse a port.
    key = f"pacing-{kind}-{uuid.uuid4().hex[:8]}"
    settings = {"api_key": key, "model": "m", "max_tokens": 8, **settings}
    if kind == "openai":
        return OpenAIResource(base_url=base_url, **settings)
    return AnthropicResource(base_url=base_url.removesuffix("/v1"), **settings)


async def ask_many(chat: OpenAIResource | AnthropicResource, n: int, learn: bool = True) -> None:
    """One request, which learns the budget (``learn``), then ``n`` at once."""
    text = "I was charged twice for my subscription this month, please refund one payment"

    async def one(i: int) -> None:
        messages: Any = [{"role": "user", "content": f"{i} {text}"}]
        if isinstance(chat, OpenAIResource):
            await chat.client().chat.completions.create(
                messages=messages, **chat.request_defaults()
            )
        else:
            await chat.client().messages.create(messages=messages, **chat.request_defaults())

    if learn:
        await one(-1)
    await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_requests_are_held_while_the_stated_budget_is_spent(kind: str) -> None:
    # 300 tokens a second, 600 at most at once; 41 requests of 28 tokens: about 1,150 tokens,
    # so half of them wait for the budget. Unpaced, a third of them are refused (below); paced,
    # one or two at most, when the server is slow to take a request in (a retry answers it).
    # Answers take 50 ms, as a model's take longer than the client's own work on a request.
    with serve(tokens_per_minute=18_000, budget_window_seconds=2, latency_ms=50) as base_url:
        asyncio.run(ask_many(endpoint(kind, base_url, max_retries=2), 40))
        served = stats(base_url)

    assert served["ok"] == 41
    assert served["over_budget"] <= 2, served


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_first_burst_waits_for_answers_that_state_the_budget(kind: str) -> None:
    # 40 requests at once, before any answer: about twice the 600 tokens the key holds. Sent
    # all at once, 19 are refused; a few go first, and the answers pace the rest. Answers take
    # 50 ms, as a model's take longer than the client's own work on a request.
    with serve(tokens_per_minute=18_000, budget_window_seconds=2, latency_ms=50) as base_url:
        asyncio.run(ask_many(endpoint(kind, base_url, max_retries=2), 40, learn=False))
        served = stats(base_url)

    assert served["ok"] == 40
    # Unpaced, 19 go over the budget. Paced, the few sent before the first answer arrives may:
    # how many depends on the machine's load (2 on a quiet machine, 4 seen beside two busy
    # workers).
    assert served["over_budget"] <= 4, served


def test_assumed_limits_pace_a_server_that_states_none() -> None:
    with serve(tokens_per_minute=18_000, budget_window_seconds=2, limit_headers=False) as url:
        chat = endpoint("openai", url, tokens_per_minute=18_000, max_retries=2)
        asyncio.run(ask_many(chat, 40))
        served = stats(url)

    assert served["ok"] == 41
    assert served["over_budget"] <= 2, served


def test_without_limits_nothing_is_held() -> None:
    with serve(tokens_per_minute=18_000, budget_window_seconds=2, limit_headers=False) as url:
        with pytest.raises(Exception, match="rate limit"):
            asyncio.run(ask_many(endpoint("openai", url), 40))
        served = stats(url)

    assert served["over_budget"] > 0


# -- two shards, two processes, one key ---------------------------------------------------------
def _materialize(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dagster", "asset", "materialize", "-m", MODULE, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _metadata(env: dict[str, str], partition: str) -> dict[str, Any]:
    with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(ASSET), asset_partitions=[partition]),
            limit=1,
        ).records
        materialization = records[0].asset_materialization
        assert materialization is not None
        return {k: v.value for k, v in materialization.metadata.items()}


@pytest.mark.slow
def test_two_shards_in_two_processes_share_the_key_and_are_seldom_refused(
    demo_env: dict[str, str],
) -> None:
    # 3,000 tokens a second for the key, 6,000 at most at once; two shards of about 100 tickets
    # of about 70 tokens each, 8 calls in flight each: about twice the budget they start with.
    budget = Settings(latency_ms=20, tokens_per_minute=180_000, budget_window_seconds=2.0)
    with serve_process(budget) as base_url:
        env = demo_env | {
            "LLM_TICKETS": "400",
            "LLM_MAX_CONCURRENCY": "8",
            "OPENAI_API_KEY": "local",
            "OPENAI_MODEL": "m",
            "OPENAI_BASE_URL": base_url,
        }
        source = _materialize(env, "--select", "llm_tickets")
        assert source.wait(timeout=300) == 0, source.stdout.read() if source.stdout else ""
        shards = [
            _materialize(env, "--select", ASSET, "--partition", p) for p in ("0-of-4", "1-of-4")
        ]
        outputs = [s.communicate(timeout=300)[0] for s in shards]
        served = stats(base_url)

    for shard, output in zip(shards, outputs, strict=True):
        assert shard.returncode == 0, output[-3000:]
    metas = [_metadata(env, p) for p in ("0-of-4", "1-of-4")]
    rows = sum(m["rows_computed"] for m in metas)
    assert served["ok"] == rows > 150
    # The budget they start with is gone after about half the calls: the rest were paced by
    # what the answers stated, the two shards sharing what was left of the key.
    assert served["over_budget"] <= 5, served
    assert sum(m["throttled_calls"] for m in metas) == served["over_budget"]
    assert all(m["refusals_per_answer"] <= 0.05 for m in metas), metas
    assert sum(m["budget_wait_seconds"] for m in metas) > 0
    assert all(0 < m["budget_used"] <= 1 for m in metas), [
        (m.get("budget_used"), m.get("refusals_per_answer")) for m in metas
    ]
