"""An HTTP proxy on 127.0.0.1 in front of the moto S3 server that injects faults per request.

Point s3fs's ``endpoint_url`` at ``proxy.endpoint``; every request is forwarded to moto unchanged
unless a ``Fault`` matches it (by method, a regular expression over ``<path>?<query>`` and how many
matching requests to let through first). What a fault does:

- ``slowdown``: answer ``503 SlowDown``, the way S3 throttles a prefix;
- ``hang``: wait ``seconds`` before forwarding (longer than the client's read timeout: a timeout);
- ``cut``: read half of the request body, then close the connection without an answer (a PUT
  that fails half way);
- ``stale``: answer a LIST with the answer moto gave to the first matching LIST (a listing that
  does not show what was written since).
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclass
class Fault:
    kind: str  # slowdown, hang, cut, stale
    method: str
    pattern: str
    times: int = 1  # how many matching requests get the fault (then it is spent)
    skip: int = 0  # matching requests let through before the first fault
    seconds: float = 0.0
    hits: int = 0
    seen: int = 0
    first_answer: tuple[int, list[tuple[str, str]], bytes] | None = field(default=None, repr=False)

    def matches(self, method: str, target: str) -> bool:
        return method == self.method and re.search(self.pattern, target) is not None


class FaultProxy:
    """A threading HTTP proxy; ``faults`` may be changed while it runs."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlparse(upstream)
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, str]] = []  # (method, target, what happened)
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def _any(self) -> None:
                proxy.handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        host, port = self.server.server_address[:2]
        self.endpoint = f"http://{host!s}:{port}"

    def add(self, fault: Fault) -> Fault:
        with self.lock:
            self.faults.append(fault)
        return fault

    def _pick(self, method: str, target: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.matches(method, target):
                    fault.seen += 1
                    if fault.kind == "stale" and fault.first_answer is None:
                        return fault  # remember this answer, serve it later
                    if fault.seen > fault.skip and fault.hits < fault.times:
                        fault.hits += 1
                        return fault
            return None

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        method, target = h.command, h.path
        length = int(h.headers.get("Content-Length") or 0)
        fault = self._pick(method, target)
        kind = fault.kind if fault else "forwarded"
        stale_now = fault is not None and fault.kind == "stale" and fault.first_answer is not None
        if fault is not None and (fault.kind != "stale" or stale_now):
            self.log.append((method, target, kind))
        if fault is not None and fault.kind == "cut":
            h.rfile.read(length // 2)
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        body = h.rfile.read(length) if length else b""
        if fault is not None and fault.kind == "slowdown":
            self._answer(h, 503, [("Content-Type", "application/xml")], SLOWDOWN)
            return
        if fault is not None and fault.kind == "hang":
            time.sleep(fault.seconds)
        if stale_now and fault is not None and fault.first_answer is not None:
            self._answer(h, *fault.first_answer)  # the old answer
            return
        try:
            status, headers, data = self._forward(h, method, target, body)
        except OSError:  # moto went away (the session ends): drop the connection
            h.close_connection = True
            return
        if fault is not None and fault.kind == "stale":
            fault.first_answer = (status, headers, data)
            self.log.append((method, target, "remembered"))
        elif fault is None:
            self.log.append((method, target, kind))
        try:
            self._answer(h, status, headers, data)
        except OSError:  # the client gave up waiting (a hang)
            h.close_connection = True

    def _forward(
        self, h: BaseHTTPRequestHandler, method: str, target: str, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("connection",)}
        conn.request(method, target, body=body or None, headers=headers)
        response = conn.getresponse()
        data = response.read()
        out = [
            (k, v)
            for k, v in response.getheaders()
            if k.lower() not in ("connection", "transfer-encoding", "content-length")
        ]
        conn.close()
        return response.status, out, data

    @staticmethod
    def _answer(
        h: BaseHTTPRequestHandler, status: int, headers: list[tuple[str, str]], data: bytes
    ) -> None:
        h.send_response(status)
        for k, v in headers:
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def spent(self) -> list[tuple[str, str, str]]:
        """The requests that got a fault."""
        return [entry for entry in self.log if entry[2] in ("slowdown", "hang", "cut", "stale")]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
