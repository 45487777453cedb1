"""The local batch provider and the local chat server on one base URL, as a provider serves
its batch API and its online endpoints: for request/parse jobs in any mode (``online``,
``batch``, ``hybrid``).

The online paths (``/v1/chat/completions``, ``/v1/messages``) go to the chat server
(``examples/llm_openai/server.py``), every other path to the batch provider (``provider.py``).
Each counts what it answered: the requests paid for are the provider's ``processed`` plus the
chat server's ``ok`` (:meth:`Both.paid`).

    with serve(Settings(processing_delay=20)) as (base_url, both):
        ...  # OpenAIResource(base_url=base_url, ...) reaches both
        both.paid()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

from starlette.types import Receive, Scope, Send

from examples import serving
from examples.llm_batch.jobs import Settings
from examples.llm_batch.provider import Provider
from examples.llm_openai.server import ChatServer
from examples.llm_openai.server import Settings as ChatSettings

ONLINE_PATHS: Final = ("/v1/chat/completions", "/v1/messages")


class Both:
    """The ASGI application: the online paths to ``chat``, the others to ``provider``."""

    def __init__(self, provider: Provider, chat: ChatServer) -> None:
        self.provider, self.chat = provider, chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> Any:
        app = self.chat if scope.get("path") in ONLINE_PATHS else self.provider
        return await app(scope, receive, send)

    def paid(self) -> int:
        """Requests answered: by the provider's batches, and online."""
        return self.provider.snapshot()["processed"] + self.chat.snapshot()["ok"]


_DEFAULTS: Final = Settings()
_CHAT_DEFAULTS: Final = ChatSettings()


@contextmanager
def serve(
    settings: Settings = _DEFAULTS, chat: ChatSettings = _CHAT_DEFAULTS
) -> Iterator[tuple[str, Both]]:
    """Serve both in a thread of this process on a free port; yield the OpenAI base URL (the
    Anthropic client takes it without ``/v1``) and the application, to read its counts."""
    both = Both(Provider(settings), ChatServer(chat))
    with serving.in_thread(both, "provider and chat server") as url:
        yield url, both
