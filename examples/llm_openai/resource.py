"""A Dagster resource that gives an ``async def`` batch function an ``openai.AsyncOpenAI`` client.

The client is made with ``max_retries=0`` by default: a rate limit (``429`` with
``Retry-After``), a server error or a dropped connection reaches the caller as the ``openai``
exception at once, so the checkpointed asset decides what to retry and how many calls to keep in
flight, instead of the client sleeping and retrying unseen inside one call.

An ``AsyncOpenAI`` client belongs to the event loop it first sends on: its pooled connections
fail with "Event loop is closed" once used from another loop. :meth:`OpenAIChat.client` therefore
keeps one client per event loop and per configuration, made on first use and reused by every
call on that loop, so the connections are shared by all the calls in flight.

>>> import dagster as dg
>>> openai_chat = OpenAIChat(
...     base_url=dg.EnvVar("OPENAI_BASE_URL"),
...     api_key=dg.EnvVar("OPENAI_API_KEY"),
...     model="gpt-4o-mini",
... )
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Final

import dagster as dg
import openai
from pydantic import Field

__all__ = ["OpenAIChat"]

_ClientKey = tuple[str | None, str, float, int]  # base_url, api_key, timeout, max_retries
_Clients = dict[_ClientKey, openai.AsyncOpenAI]
_CLIENTS: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Clients]] = (
    weakref.WeakKeyDictionary()
)
_CLIENTS_LOCK: Final = threading.Lock()


class OpenAIChat(dg.ConfigurableResource):
    """An OpenAI-compatible chat endpoint, for ``async def`` batch functions.

    Works with the OpenAI API and any server that speaks its protocol (vLLM, Ollama, LiteLLM,
    the local ``examples.llm_openai.server``)::

        async def route(batch: pl.DataFrame, openai_chat: OpenAIChat) -> pl.DataFrame:
            client = openai_chat.client()
            reply = await client.chat.completions.create(
                model=openai_chat.model, messages=[{"role": "user", "content": text}]
            )
    """

    base_url: str | None = Field(
        default=None,
        description="Base URL of the endpoint, ending in /v1; unset means the OpenAI API. "
        "Usually dg.EnvVar('OPENAI_BASE_URL').",
    )
    api_key: str = Field(
        description="API key sent as a bearer token. Usually dg.EnvVar('OPENAI_API_KEY'); "
        "any value for a local server that checks none."
    )
    model: str = Field(description="The model name to send with each request.")
    timeout_seconds: float = Field(
        default=60.0, gt=0, description="Seconds before one request fails with a timeout."
    )
    max_retries: int = Field(
        default=0,
        ge=0,
        description="Retries inside the openai client. Keep 0 so rate limits and errors reach "
        "the checkpointed asset, which retries failed batches and adapts its concurrency.",
    )

    def client(self) -> openai.AsyncOpenAI:
        """The ``AsyncOpenAI`` client of the running event loop: made once, then reused.

        Call it inside an ``async def`` function (a coroutine running on an event loop).
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "OpenAIChat.client() returns an asyncio client and needs a running event loop: "
                "call it inside an `async def` batch function"
            ) from None
        key: _ClientKey = (self.base_url, self.api_key, self.timeout_seconds, self.max_retries)
        with _CLIENTS_LOCK:
            clients = _CLIENTS.setdefault(loop, {})
            client = clients.get(key)
            if client is None:
                client = openai.AsyncOpenAI(
                    base_url=self.base_url,
                    api_key=self.api_key,
                    timeout=self.timeout_seconds,
                    max_retries=self.max_retries,
                )
                clients[key] = client
        return client
