"""The local server's Anthropic route (``POST /v1/messages``), through the real ``anthropic``
client over real HTTP: the answer and usage a job stores, and each failure surfacing as the
exception the client raises for it."""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("anthropic") is None:  # an optional extra; CI must have it
    if os.environ.get("CI") == "true":
        pytest.fail("anthropic is not installed: pip install -e '.[anthropic]'", pytrace=False)
    pytest.skip(
        "anthropic is not installed: pip install -e '.[anthropic]'", allow_module_level=True
    )

import anthropic

from examples.llm_openai.server import Settings, serve, stats

SYSTEM = "Route the ticket (billing, sales, other)."
TICKET = "Charged twice this month\n\nMy invoice shows two payments for the same subscription."


def client(base_url: str) -> anthropic.Anthropic:
    # The anthropic client's base URL has no /v1: it adds it to each path.
    return anthropic.Anthropic(
        base_url=base_url.removesuffix("/v1"), api_key="local", max_retries=0, timeout=10
    )


def ask(c: anthropic.Anthropic, text: str = TICKET) -> str:
    message = c.messages.create(
        model="claude-test", max_tokens=8, messages=[{"role": "user", "content": text}]
    )
    block = message.content[0]
    assert block.type == "text"
    return block.text


def test_a_message_answers_the_department_with_token_usage() -> None:
    with serve() as base_url:
        message = client(base_url).messages.create(
            model="claude-test",
            max_tokens=8,
            system=SYSTEM,
            messages=[{"role": "user", "content": TICKET}],
        )
        served = stats(base_url)

    assert message.type == "message" and message.role == "assistant"
    assert message.model == "claude-test"
    assert [(b.type, getattr(b, "text", None)) for b in message.content] == [("text", "billing")]
    assert message.stop_reason == "end_turn"
    prompt_words = len(SYSTEM.split()) + len(TICKET.split())
    assert (message.usage.input_tokens, message.usage.output_tokens) == (prompt_words, 1)
    assert served["ok"] == served["requests"] == 1
    assert (served["prompt_tokens"], served["completion_tokens"]) == (prompt_words, 1)


def test_text_blocks_and_a_conversation_are_read_like_strings() -> None:
    with serve() as base_url:
        message = client(base_url).messages.create(
            model="m",
            max_tokens=8,
            system=[{"type": "text", "text": SYSTEM}],
            messages=[
                {"role": "user", "content": "I was charged twice"},
                {"role": "assistant", "content": "billing"},
                {"role": "user", "content": [{"type": "text", "text": "where is my package?"}]},
            ],
        )

    # The last user message is the one classified.
    assert message.content[0].type == "text" and message.content[0].text == "shipping"
    assert message.usage.input_tokens == len(SYSTEM.split()) + 4 + 1 + 4


def test_a_rate_limit_arrives_as_rate_limit_error_with_retry_after() -> None:
    with serve(rate_429=1.0, retry_after_seconds=2.5) as base_url:
        with pytest.raises(anthropic.RateLimitError) as raised:
            ask(client(base_url))
        served = stats(base_url)

    assert raised.value.response.headers["retry-after"] == "3"  # whole seconds, rounded up
    assert raised.value.type == "rate_limit_error"
    assert served["rate_limited"] == served["requests"] == 1  # no retry hidden in the client


def test_an_overloaded_api_arrives_as_overloaded_error() -> None:
    with serve(rate_529=1.0) as base_url:
        with pytest.raises(anthropic.OverloadedError) as raised:
            ask(client(base_url))
        served = stats(base_url)

    assert raised.value.status_code == 529 and raised.value.type == "overloaded_error"
    assert served["overloaded"] == served["requests"] == 1


def test_a_server_error_arrives_as_internal_server_error() -> None:
    with serve(rate_500=1.0) as base_url, pytest.raises(anthropic.InternalServerError) as raised:
        ask(client(base_url))

    assert raised.value.status_code == 500 and raised.value.type == "api_error"


def test_a_dropped_connection_arrives_as_connection_error() -> None:
    with serve(rate_drop=1.0) as base_url, pytest.raises(anthropic.APIConnectionError) as raised:
        ask(client(base_url))

    assert not isinstance(raised.value, anthropic.APITimeoutError)


def test_a_malformed_request_is_refused_with_bad_request() -> None:
    with serve() as base_url:
        with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
            client(base_url).messages.create(
                model="m", max_tokens=0, messages=[{"role": "user", "content": "refund"}]
            )
        assert stats(base_url)["bad_request"] == 1


def test_failures_are_reproducible_by_seed() -> None:
    prompts = [f"ticket {i % 10}" for i in range(20)]  # each prompt sent twice: two attempts

    def outcomes(seed: int) -> list[str]:
        seen = []
        with serve(rate_429=0.3, rate_500=0.2, rate_529=0.2, seed=seed) as base_url:
            c = client(base_url)
            for text in prompts:
                try:
                    ask(c, text)
                    seen.append("ok")
                except anthropic.RateLimitError:
                    seen.append("rate_limited")
                except anthropic.OverloadedError:  # before InternalServerError, its base
                    seen.append("overloaded")
                except anthropic.InternalServerError:
                    seen.append("server_error")
            assert stats(base_url)["overloaded"] == seen.count("overloaded")
        return seen

    first = outcomes(seed=3)

    assert outcomes(seed=3) == first
    assert set(first) == {"ok", "rate_limited", "server_error", "overloaded"}


def test_the_rates_with_overloads_may_not_exceed_one() -> None:
    with pytest.raises(ValueError, match="rate_529 must be between 0 and 1"):
        Settings(rate_529=-0.1)
    with pytest.raises(ValueError, match=r"rate_429 \+ rate_500 \+ rate_drop \+ rate_529"):
        Settings(rate_429=0.5, rate_529=0.6)
