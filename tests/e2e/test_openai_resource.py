"""The ``OpenAIChat`` resource against the local OpenAI-compatible server, over real HTTP."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest

if importlib.util.find_spec("openai") is None:  # an optional extra; CI must have it
    if os.environ.get("CI") == "true":
        pytest.fail("openai is not installed: pip install -e '.[openai]'", pytrace=False)
    pytest.skip("openai is not installed: pip install -e '.[openai]'", allow_module_level=True)

import dagster as dg
import openai

from examples.llm_openai.resource import OpenAIChat
from examples.llm_openai.server import serve, stats


async def route(chat: OpenAIChat, text: str) -> str | None:
    reply = await chat.client().chat.completions.create(
        model=chat.model, messages=[{"role": "user", "content": text}]
    )
    return reply.choices[0].message.content


def test_one_client_per_event_loop_serves_every_run() -> None:
    async def two_calls(chat: OpenAIChat) -> tuple[openai.AsyncOpenAI, list[str | None]]:
        answers = await asyncio.gather(route(chat, "refund please"), route(chat, "tracking?"))
        assert chat.client() is chat.client()
        return chat.client(), list(answers)

    with serve() as base_url:
        chat = OpenAIChat(base_url=base_url, api_key="local", model="m")
        # A client reused on a second event loop fails with "Event loop is closed".
        first, answers = asyncio.run(two_calls(chat))
        second, again = asyncio.run(two_calls(chat))

    assert answers == again == ["billing", "shipping"]
    assert first is not second


def test_a_rate_limit_reaches_the_caller_without_hidden_retries() -> None:
    with serve(rate_429=1.0, retry_after_seconds=0.1) as base_url:
        chat = OpenAIChat(base_url=base_url, api_key="local", model="m")
        with pytest.raises(openai.RateLimitError):
            asyncio.run(route(chat, "refund please"))
        served = stats(base_url)

    assert served["rate_limited"] == served["requests"] == 1


def test_the_client_outside_an_event_loop_says_to_use_async_def() -> None:
    chat = OpenAIChat(base_url="http://127.0.0.1:9/v1", api_key="local", model="m")
    with pytest.raises(RuntimeError, match="async def"):
        chat.client()


def test_an_async_asset_gets_its_endpoint_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @dg.asset
    async def department(openai_chat: OpenAIChat) -> str | None:
        return await route(openai_chat, "I was charged twice")

    with serve() as base_url:
        monkeypatch.setenv("OPENAI_BASE_URL", base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "local")
        chat = OpenAIChat(
            base_url=dg.EnvVar("OPENAI_BASE_URL"), api_key=dg.EnvVar("OPENAI_API_KEY"), model="m"
        )
        result = dg.materialize([department], resources={"openai_chat": chat})
        served = stats(base_url)

    assert result.output_for_node("department") == "billing"
    assert served["ok"] == 1
