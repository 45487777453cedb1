"""The local OpenAI-compatible server, through the real ``openai`` client over real HTTP.

Tests and benchmarks of remote-model jobs rely on it answering like the OpenAI API: the answer
and usage a job stores, and each failure surfacing as the exception the client raises for it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

if importlib.util.find_spec("openai") is None:  # an optional extra; CI must have it
    if os.environ.get("CI") == "true":
        pytest.fail("openai is not installed: pip install -e '.[openai]'", pytrace=False)
    pytest.skip("openai is not installed: pip install -e '.[openai]'", allow_module_level=True)

import openai

from examples.llm_openai.server import Settings, classify, serve, serve_process, stats
from examples.ticket_routing.data import generate_tickets
from examples.ticket_routing.model import FakeRouter

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "Route the ticket (billing, sales, other)."
TICKET = "Charged twice this month\n\nMy invoice shows two payments for the same subscription."


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="local", max_retries=0, timeout=10)


def ask(c: openai.OpenAI, text: str = TICKET) -> str | None:
    reply = c.chat.completions.create(
        model="ticket-router-1",
        messages=[
            {"role": "system", "content": "Name the department for this ticket: billing or sales"},
            {"role": "user", "content": text},
        ],
    )
    return reply.choices[0].message.content


def port_is_open(base_url: str) -> bool:
    parts = urlsplit(base_url)
    with socket.socket() as s:
        return s.connect_ex((parts.hostname or "", parts.port or 0)) == 0


def test_a_completion_answers_the_department_with_token_usage() -> None:
    with serve() as base_url:
        reply = client(base_url).chat.completions.create(
            model="my-model",
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": TICKET},
            ],
        )
        served = stats(base_url)

    assert reply.object == "chat.completion"
    assert reply.model == "my-model"
    assert reply.choices[0].message.content == "billing"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None
    prompt_words = len(SYSTEM.split()) + len(TICKET.split())
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_words, 1)
    assert reply.usage.total_tokens == prompt_words + 1
    assert served["ok"] == served["requests"] == 1
    assert (served["prompt_tokens"], served["completion_tokens"]) == (prompt_words, 1)


def test_answers_are_the_demo_routers_departments() -> None:
    tickets = generate_tickets(60)
    expected = FakeRouter().route(tickets)["department"].to_list()
    texts = [f"{s} {b}" for s, b in zip(tickets["subject"], tickets["body"], strict=True)]

    with serve() as base_url:
        c = client(base_url)
        answers = [ask(c, t) for t in texts[:5]]

    assert answers == expected[:5]
    assert [classify(t) for t in texts] == expected
    assert len(set(expected)) >= 4  # the tickets exercise most departments


def test_the_model_list_names_the_served_model() -> None:
    with serve(model="local-router") as base_url:
        models = client(base_url).models.list()

    assert [m.id for m in models.data] == ["local-router"]


def test_a_rate_limit_arrives_as_rate_limit_error_with_retry_after() -> None:
    with serve(rate_429=1.0, retry_after_seconds=2.5) as base_url:
        with pytest.raises(openai.RateLimitError) as raised:
            ask(client(base_url))
        served = stats(base_url)

    headers = raised.value.response.headers
    assert headers["retry-after"] == "3"  # whole seconds, rounded up, as HTTP allows
    assert headers["retry-after-ms"] == "2500"
    assert raised.value.code == "rate_limit_exceeded"
    assert served["rate_limited"] == served["requests"] == 1  # no retry hidden in the client


def test_a_server_error_arrives_as_internal_server_error() -> None:
    with serve(rate_500=1.0) as base_url:
        with pytest.raises(openai.InternalServerError) as raised:
            ask(client(base_url))
        served = stats(base_url)

    assert raised.value.status_code == 500
    assert served["server_error"] == 1


def test_a_dropped_connection_arrives_as_connection_error() -> None:
    with serve(rate_drop=1.0) as base_url:
        c = client(base_url)
        with pytest.raises(openai.APIConnectionError) as raised:
            ask(c)
        served = stats(base_url)

    assert not isinstance(raised.value, openai.APITimeoutError)
    assert served["dropped"] == 1


def test_a_malformed_request_is_refused_with_bad_request() -> None:
    with serve() as base_url:
        with pytest.raises(openai.BadRequestError, match="messages"):
            client(base_url).chat.completions.create(model="m", messages=[])
        assert stats(base_url)["bad_request"] == 1


def test_requests_beyond_the_admission_limit_get_429_at_once() -> None:
    async def burst(base_url: str) -> list[BaseException | object]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="local", max_retries=0) as c:
            calls = [
                c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"refund {i}"}]
                )
                for i in range(6)
            ]
            return await asyncio.gather(*calls, return_exceptions=True)

    with serve(latency_ms=1000, max_in_flight=2, retry_after_seconds=0.5) as base_url:
        results = asyncio.run(burst(base_url))
        served = stats(base_url)

    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(refused) == 4
    assert all(r.response.headers["retry-after-ms"] == "500" for r in refused)
    assert served["ok"] == 2 and served["throttled"] == 4
    assert served["peak_in_flight"] == 2


async def burst(base_url: str, n: int) -> list[str]:
    """``n`` requests at once: which were answered and which refused."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="local", max_retries=0) as c:
        calls = [
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{i}"}])
            for i in range(n)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
    return sorted("429" if isinstance(r, openai.RateLimitError) else "ok" for r in results)


def test_the_admission_limit_follows_its_schedule_from_the_first_request() -> None:
    settings = Settings(latency_ms=1000, limit_schedule=((0, 1), (0.5, 3)))
    with serve_process(settings) as base_url:
        first = asyncio.run(burst(base_url, 3))
        time.sleep(0.6)  # the schedule started before the first burst returned
        later = asyncio.run(burst(base_url, 3))
        served = stats(base_url)

    assert first == ["429", "429", "ok"]  # a limit of 1 at first
    assert later == ["ok", "ok", "ok"]  # 3 from 0.5 s on
    assert served["throttled"] == 2 and served["peak_in_flight"] == 3


def outcomes(base_url: str, prompts: list[str]) -> list[str]:
    c = client(base_url)
    seen = []
    for text in prompts:
        try:
            ask(c, text)
            seen.append("ok")
        except openai.RateLimitError:
            seen.append("rate_limited")
        except openai.InternalServerError:
            seen.append("server_error")
        except openai.APIConnectionError:
            seen.append("dropped")
    return seen


def test_failures_are_reproducible_by_seed_and_counted_in_stats() -> None:
    prompts = [f"ticket {i % 20}" for i in range(40)]  # each prompt sent twice: two attempts

    def run(seed: int) -> tuple[list[str], dict[str, int]]:
        with serve(rate_429=0.3, rate_500=0.2, rate_drop=0.1, seed=seed) as base_url:
            return outcomes(base_url, prompts), stats(base_url)

    first, served = run(seed=3)
    again, _ = run(seed=3)
    other_seed, _ = run(seed=4)

    assert again == first
    assert other_seed != first
    assert set(first) == {"ok", "rate_limited", "server_error", "dropped"}
    assert first[:20] != first[20:]  # a prompt's second attempt has its own fate
    for outcome in ("ok", "rate_limited", "server_error", "dropped"):
        assert served[outcome] == first.count(outcome), outcome
    assert served["requests"] == len(prompts)


def test_settings_out_of_range_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="rate_429 must be between 0 and 1"):
        Settings(rate_429=1.5)
    with pytest.raises(ValueError, match="at most 1"):
        Settings(rate_429=0.6, rate_500=0.6)
    with pytest.raises(ValueError, match="max_in_flight"):
        Settings(max_in_flight=0)
    with pytest.raises(ValueError, match="latency_ms"):
        Settings(latency_ms=-1)
    with pytest.raises(ValueError, match="limit_schedule must be in time order"):
        Settings(limit_schedule=((4, 8), (2, 32)))
    with pytest.raises(ValueError, match="limit_schedule limits"):
        Settings(limit_schedule=((0, 0),))


def test_the_in_process_server_releases_its_port_on_exit() -> None:
    with serve() as base_url:
        assert port_is_open(base_url)
    assert not port_is_open(base_url)


def start_process(*options: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "examples.llm_openai.server", "--port", "0", *options],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_the_server_process_prints_its_url_and_stops_cleanly(stop: signal.Signals) -> None:
    process = start_process("--latency-ms", "10")
    try:
        assert process.stdout is not None
        first = process.stdout.readline().strip()
        assert first.startswith("listening on http://127.0.0.1:")
        base_url = first.removeprefix("listening on ")
        assert base_url.endswith("/v1")
        assert ask(client(base_url)) == "billing"
        process.send_signal(stop)
        _, err = process.communicate(timeout=15)
    finally:
        process.kill()
        process.wait()

    assert process.returncode == 0, err
    assert "Traceback" not in err
    assert not port_is_open(base_url)


def test_the_server_process_refuses_bad_options_with_the_reason() -> None:
    process = start_process("--rate-500", "2")
    _, err = process.communicate(timeout=30)

    assert process.returncode == 2
    assert "rate_500 must be between 0 and 1" in err


def test_the_server_process_refuses_a_malformed_schedule_with_an_example() -> None:
    process = start_process("--limit-schedule", "4-8")
    _, err = process.communicate(timeout=30)

    assert process.returncode == 2
    assert "SECONDS:LIMIT pairs" in err and "4:8,10:32" in err
