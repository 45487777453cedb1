"""An OpenAI-compatible batch API that differs from OpenAI's where other providers' documentation
says theirs do, in front of the local batch provider and chat server (``online.py``'s ``Both``),
for tests: the ``openai`` client works against it with the resource's ``base_url``.

- ``windows``: the completion windows it takes (OpenAI: ``24h`` only; others up to ``7d``); any
  other is refused with ``400``. The batches themselves run on the local provider's clock.
- ``metadata``: ``keep`` (OpenAI's), ``drop`` (accepted, never returned), or ``refuse``
  (``400`` "Unknown parameter").

    with serve(Compatibility(windows=("24h", "7d"), metadata="drop")) as (base_url, both):
        client = openai.OpenAI(base_url=base_url, api_key="local")
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from starlette.types import Receive, Scope, Send

from examples import serving
from examples.llm_batch.azure_api import forward, read_body, refuse
from examples.llm_batch.jobs import Settings
from examples.llm_batch.online import Both
from examples.llm_batch.provider import Provider
from examples.llm_openai.server import ChatServer
from examples.llm_openai.server import Settings as ChatSettings


@dataclass(frozen=True)
class Compatibility:
    """How the batch API differs from OpenAI's (see the module docstring)."""

    windows: tuple[str, ...] = ("24h",)
    metadata: Literal["keep", "drop", "refuse"] = "keep"


class CompatibleBatchAPI:
    """The ASGI application: batch creates checked and rewritten, the rest passed to ``inner``."""

    def __init__(self, inner: Both, compatibility: Compatibility) -> None:
        self.inner, self.compatibility = inner, compatibility

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> Any:
        if scope["type"] != "http" or (scope["method"], scope["path"]) != ("POST", "/v1/batches"):
            return await self.inner(scope, receive, send)
        created = json.loads(await read_body(receive) or b"{}")
        c = self.compatibility
        window = created.get("completion_window")
        if window not in c.windows:
            said = ", ".join(c.windows)
            return await refuse(send, 400, f"completion_window must be one of {said}")
        if "metadata" in created and c.metadata == "refuse":
            return await refuse(send, 400, "Unknown parameter: 'metadata'.")
        if c.metadata == "drop":
            created.pop("metadata", None)
        created["completion_window"] = "24h"  # the local provider's one window
        return await forward(self.inner, scope, send, "/v1/batches", json.dumps(created).encode())


@contextmanager
def serve(
    compatibility: Compatibility,
    settings: Settings = Settings(),  # noqa: B008  # frozen
    *,
    clock: Callable[[], float] = time.time,
) -> Iterator[tuple[str, Both]]:
    """Serve it in a thread of this process on a free port; yield its base URL (``/v1``) and
    the local provider and chat server behind it, to read their counts."""
    both = Both(Provider(settings, clock), ChatServer(ChatSettings()))
    with serving.in_thread(CompatibleBatchAPI(both, compatibility), "batch API") as url:
        yield url, both
