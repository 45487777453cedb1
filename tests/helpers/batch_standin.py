"""A minimal stand-in for OpenAI's Files + Batches API, for the provider batch tests until the
local provider (``examples/llm_batch/provider.py``) is there: the real ``openai`` client talks to
it over HTTP.

A batch is ``validating`` then ``completed`` ``delay`` seconds after it was created; requests
whose ``custom_id`` hashes below ``error_rate`` get an error line (a 500); the first ``expire``
batches expire instead, with results for their first half; ``cancel`` ends one the same way.
``GET /stats`` counts uploads, creates, polls, lists, downloads and requests processed.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Provider:
    def __init__(self, delay: float, error_rate: float, expire: int) -> None:
        self.delay, self.error_rate, self.expire = delay, error_rate, expire
        self.files: dict[str, bytes] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self.stats: Counter[str] = Counter()
        self.ids = itertools.count(1)
        self.lock = threading.Lock()

    def new_id(self, kind: str) -> str:
        return f"{kind}-{next(self.ids)}"

    def view(self, b: dict[str, Any]) -> dict[str, Any]:
        """The batch as the API shows it now, ending it (and writing its files) when due."""
        if b["status"] in ("validating", "cancelling") and (
            time.time() >= b["_created"] + self.delay or b["status"] == "cancelling"
        ):
            if b["status"] == "cancelling":
                self.end(b, "cancelled", half=True)
            else:
                expire = self.expire > 0
                self.expire -= expire
                self.end(b, "expired" if expire else "completed", half=expire)
        return {k: v for k, v in b.items() if not k.startswith("_")}

    def end(self, b: dict[str, Any], status: str, *, half: bool) -> None:
        lines = [json.loads(x) for x in self.files[b["input_file_id"]].splitlines() if x.strip()]
        if half:
            lines = lines[: len(lines) // 2]
        out, err = [], []
        for line in lines:
            self.stats["requests"] += 1
            cid = line["custom_id"]
            h = int(hashlib.sha256(cid.encode()).hexdigest()[:8], 16) / 2**32
            if h < self.error_rate:
                body = {"error": {"message": "server error", "type": "server_error"}}
                err.append({"custom_id": cid, "response": {"status_code": 500, "body": body}})
                continue
            text = line["body"]["messages"][-1]["content"]
            body = {
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text[::-1]}}],
                "usage": {"prompt_tokens": len(text.split()), "completion_tokens": 1},
            }
            out.append({"custom_id": cid, "response": {"status_code": 200, "body": body}})
        for key, rows in (("output_file_id", out), ("error_file_id", err)):
            if rows:
                fid = self.new_id("file")
                self.files[fid] = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
                b[key] = fid
        b["status"] = status
        b["request_counts"] = {"total": b["_total"], "completed": len(out), "failed": len(err)}


def _handler(p: Provider) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def send(self, obj: Any, raw: bytes | None = None) -> None:
            data = raw if raw is not None else json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("content-length") or 0))

        def do_POST(self) -> None:
            path = self.path.split("?")[0]
            data = self.body()
            with p.lock:
                if path == "/v1/files":
                    boundary = self.headers["content-type"].split("boundary=")[1].encode()
                    for part in data.split(b"--" + boundary):
                        if b'name="file"' in part:
                            content = part.split(b"\r\n\r\n", 1)[1].rsplit(b"\r\n", 1)[0]
                    fid = p.new_id("file")
                    p.files[fid] = content
                    p.stats["uploads"] += 1
                    self.send(
                        {
                            "id": fid,
                            "object": "file",
                            "bytes": len(content),
                            "created_at": 0,
                            "filename": "x.jsonl",
                            "purpose": "batch",
                            "status": "processed",
                        }
                    )
                elif path == "/v1/batches":
                    req = json.loads(data)
                    bid = p.new_id("batch")
                    total = len([x for x in p.files[req["input_file_id"]].splitlines() if x])
                    p.batches[bid] = {
                        "id": bid,
                        "object": "batch",
                        "endpoint": req["endpoint"],
                        "input_file_id": req["input_file_id"],
                        "completion_window": "24h",
                        "status": "validating",
                        "created_at": int(time.time()),
                        "metadata": req.get("metadata"),
                        "_total": total,
                        "_created": time.time(),
                        "request_counts": {"total": total, "completed": 0, "failed": 0},
                    }
                    p.stats["creates"] += 1
                    self.send(p.view(p.batches[bid]))
                elif path.endswith("/cancel"):
                    b = p.batches[path.split("/")[3]]
                    if b["status"] == "validating":
                        b["status"] = "cancelling"
                    self.send(p.view(b))

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            with p.lock:
                if path == "/stats":
                    self.send(dict(p.stats))
                elif path == "/v1/batches":
                    p.stats["lists"] += 1
                    data = [p.view(b) for b in reversed(list(p.batches.values()))]
                    self.send({"object": "list", "data": data, "has_more": False})
                elif path.startswith("/v1/batches/"):
                    p.stats["polls"] += 1
                    self.send(p.view(p.batches[path.split("/")[3]]))
                elif path.endswith("/content"):
                    p.stats["downloads"] += 1
                    self.send(None, p.files[path.split("/")[3]])

    return Handler


@contextlib.contextmanager
def serve(
    delay: float = 0.2, error_rate: float = 0.0, expire: int = 0
) -> Iterator[tuple[str, Provider]]:
    """The base URL (ending in /v1) of a stand-in on a free port, and its state."""
    provider = Provider(delay, error_rate, expire)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(provider))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", provider
    finally:
        server.shutdown()
        server.server_close()
