"""Running a local test server (the chat server of ``examples.llm_openai``, the batch provider of
``examples.llm_batch``) on 127.0.0.1: in a thread of this process or as a process of its own, on
a free port, and reading its ``GET /stats``.

Each server module keeps its own ``serve``, ``serve_process`` and ``main`` (its settings, its
command line) and hands the running of it to these helpers, so both run the same way: one uvicorn
configuration, the first line printed ``listening on BASE_URL``, SIGTERM a clean exit.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, Final

import uvicorn

#: An ASGI application (``ChatServer``, ``Provider``).
App = Callable[..., Any]

#: The folder holding the ``examples`` package, where ``python -m examples...`` starts.
_REPO: Final = str(Path(__file__).resolve().parents[1])
_LISTENING: Final = "listening on "


class _QuietDrops(logging.Filter):
    """Hide uvicorn's complaint about an application's deliberate dropped connections (the chat
    server's ``rate_drop``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("ASGI callable should return None")


_QUIET_DROPS: Final = _QuietDrops()


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)
    return sock


def _server(app: App, log_level: str, own_logging: bool) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``own_logging`` lets uvicorn configure logging."""
    config = uvicorn.Config(
        app,
        interface="asgi3",
        lifespan="off",
        access_log=False,
        proxy_headers=False,
        log_level=log_level,
        log_config=uvicorn.config.LOGGING_CONFIG if own_logging else None,
        # Longer than a client's pause between calls or polls (uvicorn's default is 5 s), so an
        # idle pooled connection is not closed just as the client reuses it: no spurious drops.
        timeout_keep_alive=120,
        timeout_graceful_shutdown=5,
    )
    logging.getLogger("uvicorn.error").addFilter(_QUIET_DROPS)
    return uvicorn.Server(config)


def _base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}/v1"


@contextmanager
def in_thread(app: App, name: str) -> Iterator[str]:
    """Serve ``app`` from a thread of this process on a free port; yield its base URL (ending in
    ``/v1``). It stops, and its port is released, when the block exits. ``name`` (``"chat
    server"``) names the thread and the error if it does not start."""
    sock = _listen(0)
    server = _server(app, log_level="warning", own_logging=False)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=name.replace(" ", "-"), daemon=True
    )
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the {name} failed to start; see its log")
            time.sleep(0.01)
        yield _base_url(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextmanager
def in_process(module: str, args: Sequence[str], name: str) -> Iterator[str]:
    """Run ``python -m module --port=0 *args`` (a server whose ``main`` is :func:`run`); yield its
    base URL. Its work then runs on its own interpreter, not on this process's: what a benchmark
    of the client wants. It is stopped with SIGTERM when the block exits."""
    argv = [sys.executable, "-m", module, "--port=0", *args]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=_REPO)
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        if not first.startswith(_LISTENING):
            raise RuntimeError(f"the {name} process did not start (it printed {first!r})")
        yield first.removeprefix(_LISTENING).strip()
    finally:
        process.terminate()
        process.wait(timeout=15)
        if process.stdout is not None:
            process.stdout.close()


def stats(base_url: str) -> dict[str, int]:
    """The server's ``GET /stats``, from its base URL (with or without ``/v1``)."""
    url = base_url.removesuffix("/").removesuffix("/v1") + "/stats"
    with urllib.request.urlopen(url, timeout=10) as response:
        result: dict[str, int] = json.load(response)
    return result


def _stop(signum: int, frame: FrameType | None) -> Any:
    raise SystemExit(0)


def run(app: App, port: int, log_level: str) -> int:
    """A server's ``main`` once its settings are read: serve ``app`` on 127.0.0.1:``port`` (0: a
    free one) until SIGTERM or SIGINT, the first line printed ``listening on BASE_URL``."""
    try:
        sock = _listen(port)
    except OSError as e:
        print(f"error: cannot listen on 127.0.0.1:{port}: {e}", file=sys.stderr)
        return 1
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal: exit with 0.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"{_LISTENING}{_base_url(sock)}", flush=True)
    _server(app, log_level, own_logging=True).run(sockets=[sock])
    return 0
