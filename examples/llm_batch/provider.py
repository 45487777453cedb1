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
in each API's error shape) and writes as results; ``common.py`` holds what they share.

``GET /stats`` counts the calls (``uploads``, ``creates``, ``retrieves`` and ``lists`` whose sum
is ``polls``, ``downloads``, ``cancels``, ``deletes``, ``refused``) and the requests
(``submitted`` in batches created, ``processed`` = ``succeeded`` + ``errored``; ``expired`` and
``cancelled`` ones left unrun; tokens), so a test can hold "requests paid == rows".

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
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, Final

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

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
)
_DEFAULTS: Final = Settings()
_REPO: Final = str(Path(__file__).resolve().parents[2])


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


# -- running it ----------------------------------------------------------------------------------
def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    return sock


def _server(app: Provider, log_level: str, own_logging: bool) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        interface="asgi3",
        lifespan="off",
        access_log=False,
        log_level=log_level,
        log_config=uvicorn.config.LOGGING_CONFIG if own_logging else None,
        # Longer than a client's pause between polls, so a pooled connection is not closed
        # just as the client reuses it.
        timeout_keep_alive=120,
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config)


def _base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}/v1"


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
    sock = _listen(0)
    server = _server(Provider(settings, clock), log_level="warning", own_logging=False)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="batch-provider", daemon=True
    )
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the batch provider failed to start; see its log")
            time.sleep(0.01)
        yield _base_url(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextmanager
def serve_process(settings: Settings = _DEFAULTS) -> Iterator[str]:
    """Run the provider as a separate process on a free port; yield its OpenAI base URL.

    Its work then runs on its own interpreter (what a benchmark wants). Stopped with SIGTERM
    when the block exits.
    """
    argv = [sys.executable, "-m", "examples.llm_batch.provider", "--port=0", *settings.argv()]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=_REPO)
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        if not first.startswith("listening on "):
            raise RuntimeError(f"the provider process did not start (it printed {first!r})")
        yield first.removeprefix("listening on ").strip()
    finally:
        process.terminate()
        process.wait(timeout=15)


def stats(base_url: str) -> dict[str, int]:
    """The provider's ``/stats`` (see :data:`STATS`)."""
    url = base_url.removesuffix("/").removesuffix("/v1") + "/stats"
    with urllib.request.urlopen(url, timeout=10) as response:
        result: dict[str, int] = json.load(response)
    return result


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


def _stop(signum: int, frame: FrameType | None) -> Any:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        settings = Settings(**{name: getattr(args, name) for name in Settings.__annotations__})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        sock = _listen(args.port)
    except OSError as e:
        print(f"error: cannot listen on 127.0.0.1:{args.port}: {e}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"listening on {_base_url(sock)}", flush=True)
    _server(Provider(settings), args.log_level, own_logging=True).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
