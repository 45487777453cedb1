"""Azure OpenAI's paths in front of the local batch provider and chat server
(``online.py``'s :class:`~examples.llm_batch.online.Both`), for tests and the example: the
``openai`` package's ``AzureOpenAI`` client works against it unchanged.

Written from Azure OpenAI's REST reference and its Batch guide::

    POST /openai/deployments/{deployment}/chat/completions?api-version=...   (online)
    POST /openai/files, GET /openai/files/{id}/content ...                    (batch input, output)
    POST /openai/batches, GET /openai/batches[/{id}], POST .../{id}/cancel    (batches)

Every path needs the ``api-version`` query parameter (else ``400``) and a credential: the
``api-key`` header, or ``Authorization: Bearer <token>`` from Microsoft Entra ID (else ``401``).
A deployment is ``standard`` (online only) or ``global_batch`` (Batch API only): an online
request to a batch deployment, or a batch input line whose ``model`` is no batch deployment, is
refused (``400``). A batch names Azure's endpoint (``/chat/completions``, no ``/v1``) in its
create and in each input line. The batches themselves are the local provider's (``jobs.py``):
they move by the same settings, and ``/stats`` counts what both answered.

    with serve(Settings(processing_delay=2)) as (endpoint, azure):
        client = openai.AzureOpenAI(azure_endpoint=endpoint, api_key=KEY, api_version="2024-10-21")
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final
from urllib.parse import parse_qs

from starlette.types import Message, Receive, Scope, Send

from examples import serving
from examples.llm_batch.jobs import CHAT, EMBEDDINGS, Settings
from examples.llm_batch.online import Both
from examples.llm_batch.provider import Provider
from examples.llm_openai.server import ChatServer
from examples.llm_openai.server import Settings as ChatSettings

KEY: Final = "local-azure-key"
TOKEN: Final = "local-entra-token"
#: The deployments of the fake resource: name -> type.
DEPLOYMENTS: Final = {"gpt-4o-mini": "standard", "gpt-4o-mini-batch": "global_batch"}
_ONLINE: Final = re.compile(r"/openai/deployments/([^/]+)(/chat/completions|/embeddings)")
_AZURE_TO_OPENAI: Final = {"/chat/completions": CHAT, "/embeddings": EMBEDDINGS}
_MODEL: Final = re.compile(rb'"model":\s*"([^"]*)"')


class AzureOpenAI:
    """The ASGI application: Azure's paths checked and passed on to ``inner`` as OpenAI's."""

    def __init__(self, inner: Both, deployments: Mapping[str, str] = DEPLOYMENTS) -> None:
        self.inner, self.deployments = inner, dict(deployments)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> Any:
        path = scope.get("path", "")
        if scope["type"] != "http" or path == "/stats":
            return await self.inner(scope, receive, send)
        refused = self._refusal(scope)
        if refused is not None:
            return await refuse(send, *refused)
        body = await read_body(receive)
        online = _ONLINE.fullmatch(path)
        if online is not None:
            deployment, endpoint = online.groups()
            kind = self.deployments.get(deployment)
            if kind != "standard":
                said = "no deployment" if kind is None else f"a {kind} deployment"
                return await refuse(
                    send,
                    400,
                    f"'{deployment}' is {said}: online requests go to a standard deployment.",
                )
            return await forward(self.inner, scope, send, _AZURE_TO_OPENAI[endpoint], body)
        if path.startswith(("/openai/files", "/openai/batches")):
            new_path = "/v1" + path.removeprefix("/openai")
            if scope["method"] == "POST" and path == "/openai/files":
                problem = self._batch_models(body)
                if problem:
                    return await refuse(send, 400, problem)
                for azure, openai in _AZURE_TO_OPENAI.items():
                    body = body.replace(f'"url":"{azure}"'.encode(), f'"url":"{openai}"'.encode())
            elif scope["method"] == "POST" and path == "/openai/batches":
                created = json.loads(body or b"{}")
                endpoint = created.get("endpoint")
                created["endpoint"] = _AZURE_TO_OPENAI.get(endpoint, f"azure:{endpoint}")
                body = json.dumps(created).encode()
            return await forward(self.inner, scope, send, new_path, body)
        return await refuse(send, 404, "Resource not found", "404")

    def _refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        query = parse_qs(scope.get("query_string", b"").decode())
        if not query.get("api-version"):
            return 400, "Missing required query parameter: api-version", "MissingApiVersion"
        headers = dict(scope["headers"])
        if (
            headers.get(b"api-key") != KEY.encode()
            and headers.get(b"authorization") != f"Bearer {TOKEN}".encode()
        ):
            return (
                401,
                "Access denied due to invalid subscription key or wrong API endpoint.",
                "401",
            )
        return None

    def _batch_models(self, upload: bytes) -> str:
        """Why a batch input file is refused: a line's model that is no batch deployment."""
        for model in {m.decode() for m in _MODEL.findall(upload)}:
            if self.deployments.get(model) != "global_batch":
                return (
                    f"The model '{model}' of a batch request is no Global Batch deployment: "
                    "batches go to a global_batch deployment."
                )
        return ""


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def forward(app: Any, scope: Scope, send: Send, path: str, body: bytes) -> Any:
    """Pass the request on to ``app`` at ``path`` with ``body`` (read whole)."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    inner = {**scope, "path": path, "raw_path": path.encode(), "headers": headers}
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return await app(inner, receive, send)


async def refuse(send: Send, status: int, message: str, code: str = "BadRequest") -> None:
    """An error in Azure's shape (``{"error": {"code", "message"}}``)."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def serve(
    settings: Settings = Settings(),  # noqa: B008  # frozen
    *,
    clock: Callable[[], float] = time.time,
    chat: ChatSettings | None = None,
) -> Iterator[tuple[str, Both]]:
    """Serve the fake Azure OpenAI resource in a thread of this process on a free port; yield
    its endpoint (``azure_endpoint``) and the local provider and chat server behind it, to read
    their counts."""
    both = Both(Provider(settings, clock), ChatServer(chat or ChatSettings()))
    with serving.in_thread(AzureOpenAI(both), "Azure OpenAI") as url:
        yield url.removesuffix("/v1"), both
