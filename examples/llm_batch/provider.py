"""A local provider of OpenAI's Batch API and Anthropic's Message Batches, for tests, the example
and benchmarks: the real ``openai`` and ``anthropic`` clients work against it unchanged.

OpenAI (base URL ``http://HOST:PORT/v1``)::

    POST /v1/files                      multipart, purpose=batch, a .jsonl of requests
    GET  /v1/files, /v1/files/{id}, /v1/files/{id}/content;  DELETE /v1/files/{id}
    POST /v1/batches                    input_file_id, endpoint, completion_window, metadata
    GET  /v1/batches (newest first, limit/after), /v1/batches/{id};  POST .../{id}/cancel

Anthropic (base URL ``http://HOST:PORT``)::

    POST /v1/messages/batches           {"requests": [{"custom_id", "params"}]}
    GET  /v1/messages/batches (newest first, limit/after_id/before_id), .../{id}
    POST .../{id}/cancel;  GET .../{id}/results (JSONL, once ended)

Batches move through their states with the clock (``jobs.py`` says how, and what each request
answers); ``openai_api.py`` and ``anthropic_api.py`` say what each API checks, refuses (limits
in each API's error shape) and writes as results; ``common.py`` holds what they share;
``examples/serving.py`` runs it (in a thread, in a process), as it runs the chat server.

``GET /stats`` counts the calls (``uploads``, ``creates``, ``retrieves`` and ``lists`` whose sum
is ``polls``, ``downloads``, ``cancels``, ``deletes``, ``refused``) and the requests
(``submitted`` in batches created, ``processed`` = ``succeeded`` + ``errored``; ``expired`` and
``cancelled`` ones left unrun; tokens), so a test can hold "requests paid == rows"; and the queue:
batches refused for want of room (``queue_refused``), the most input tokens (OpenAI,
``enqueued_peak``) and requests (Anthropic, ``queued_peak``) waiting at once.

Start it from a shell (the first line printed is the OpenAI base URL; Anthropic's is the same
without ``/v1``)::

    python -m examples.llm_batch.provider --port 0 --processing-delay 60 --error-rate 0.05
    listening on http://127.0.0.1:PORT/v1

or in a thread of a test, on a free port::

    with serve(Settings(processing_delay=2, error_rate=0.05)) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="local")
        claude = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="local")
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from examples import serving
from examples.llm_batch.anthropic_api import MessageBatchAPI
from examples.llm_batch.common import Ledger
from examples.llm_batch.jobs import ManualClock, Settings
from examples.llm_batch.openai_api import OpenAIBatchAPI

__all__ = ["STATS", "ManualClock", "Provider", "Settings", "serve", "serve_process", "stats"]

#: The counts ``GET /stats`` returns (see the module docstring).
STATS: Final = (
    "uploads",
    "creates",
    "retrieves",
    "lists",
    "polls",
    "downloads",
    "cancels",
    "deletes",
    "refused",
    "submitted",
    "processed",
    "succeeded",
    "errored",
    "expired",
    "cancelled",
    "input_tokens",
    "output_tokens",
    "queue_refused",
    "enqueued_peak",
    "queued_peak",
)
_DEFAULTS: Final = Settings()


class Provider:
    """The ASGI application: both batch APIs on one :class:`~examples.llm_batch.common.Ledger`,
    and ``/stats``. ``clock`` gives the time batches move by: ``time.time``, or a
    :class:`ManualClock` for a test that walks a batch through its states."""

    def __init__(self, settings: Settings = _DEFAULTS, clock: Callable[[], float] = time.time):
        self.ledger = Ledger(settings, clock)
        routes = [
            *OpenAIBatchAPI(self.ledger).routes(),
            *MessageBatchAPI(self.ledger).routes(),
            Route("/stats", self._stats, methods=["GET"]),
        ]
        self._router = Router(routes=routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._router(scope, receive, send)

    def snapshot(self) -> dict[str, int]:
        """What ``/stats`` returns, every batch brought up to now first."""
        self.ledger.settle_all()
        counts = {name: self.ledger.counts[name] for name in STATS}
        counts["polls"] = counts["retrieves"] + counts["lists"]
        return counts

    async def _stats(self, request: Request) -> Response:
        return JSONResponse(self.snapshot())


# -- running it (examples/serving.py) -----------------------------------------------------------
@contextmanager
def serve(
    settings: Settings = _DEFAULTS, *, clock: Callable[[], float] = time.time
) -> Iterator[str]:
    """Run the provider in a thread of this process on a free port; yield its OpenAI base URL
    (ending in ``/v1``; Anthropic's client takes it without). Stopped when the block exits.

    >>> with serve(Settings(processing_delay=5)) as base_url:
    ...     stats(base_url)["creates"]
    0
    """
    with serving.in_thread(Provider(settings, clock), "batch provider") as url:
        yield url


@contextmanager
def serve_process(settings: Settings = _DEFAULTS) -> Iterator[str]:
    """Run the provider as a separate process on a free port; yield its OpenAI base URL.

    Its work then runs on its own interpreter (what a benchmark wants). Stopped with SIGTERM
    when the block exits.
    """
    with serving.in_process("examples.llm_batch.provider", settings.argv(), "provider") as url:
        yield url


def stats(base_url: str) -> dict[str, int]:
    """The provider's ``/stats`` (see :data:`STATS`)."""
    return serving.stats(base_url)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m examples.llm_batch.provider",
        description="A local provider of OpenAI's Batch API and Anthropic's Message Batches on "
        "127.0.0.1. The first line printed is its OpenAI base URL.",
    )
    p.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (default)")
    for name, kind in Settings.__annotations__.items():
        default = getattr(_DEFAULTS, name)
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=int if kind == "int" else float,
            default=default,
            help=f"see examples/llm_batch/jobs.py (default {default})",
        )
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        settings = Settings(**{name: getattr(args, name) for name in Settings.__annotations__})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serving.run(Provider(settings), args.port, args.log_level)


if __name__ == "__main__":
    sys.exit(main())
