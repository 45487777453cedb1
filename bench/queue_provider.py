"""A batch API provider whose queue is smaller than the backfill, for ``bench/queue.py``.

Written apart from the package and from ``examples/llm_batch`` (which the tests use), so the
benchmark does not test the package against a server shaped by the same hands. It speaks enough
of both APIs for the real ``openai`` and ``anthropic`` clients, and bounds its queue as they do:

- OpenAI (``/v1/files``, ``/v1/batches``): the input tokens of the batches not completed may not
  pass ``--enqueued-tokens``. A batch that would is created in status ``failed`` with
  ``errors.data[0].code == "token_limit_exceeded"`` and OpenAI's message, which states the limit.
  Tokens are counted as OpenAI's rule of thumb for English text: 4 characters a token, over the
  text of each message (``--chars-per-token``).
- Anthropic (``/v1/messages/batches``): the requests of the batches still processing may not pass
  ``--queued-requests``. A create that would is answered ``429 rate_limit_error`` with
  ``retry-after``, and a message that states no number.

A batch takes ``--seconds`` plus ``--ms-per-request`` per request once created, then every request
succeeds with a fixed answer. ``GET /stats`` gives the counts and the queue's use: the limit's
share taken, integrated over time from the first create to the last batch's end, and its peak.

    python -m bench.queue_provider --enqueued-tokens 12000 --queued-requests 1200
    listening on http://127.0.0.1:PORT/v1
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


@dataclass
class Batch:
    id: str
    api: str  # "openai" or "anthropic"
    lines: list[dict[str, Any]]  # custom_id and body (params)
    created: float
    ends: float
    tokens: int = 0
    refused: str | None = None  # OpenAI: the token_limit_exceeded message
    metadata: dict[str, Any] = field(default_factory=dict)
    output_file: str | None = None


class QueueProvider:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.files: dict[str, bytes] = {}
        self.batches: dict[str, Batch] = {}
        self.counts: dict[str, float] = dict.fromkeys(
            ("creates", "refused", "refused_429", "submitted", "processed", "polls"), 0
        )
        self.steps: list[tuple[float, int]] = []  # (time, queue size) after each change
        self.peak = 0

    # -- the queue ----------------------------------------------------------------------------
    def waiting(self, api: str, now: float) -> list[Batch]:
        return [b for b in self.batches.values() if b.api == api and not b.refused and b.ends > now]

    def size(self, api: str, now: float) -> int:
        if api == "openai":
            return sum(b.tokens for b in self.waiting(api, now))
        return sum(len(b.lines) for b in self.waiting(api, now))

    def note(self, api: str, now: float) -> None:
        size = self.size(api, now)
        self.peak = max(self.peak, size)
        self.steps.append((now, size))

    def tokens(self, body: dict[str, Any]) -> int:
        text = "".join(str(m.get("content", "")) for m in body.get("messages", []))
        return math.ceil(len(text) / float(self.args.chars_per_token))

    def new(self, api: str, lines: list[dict[str, Any]], now: float) -> Batch:
        seconds = self.args.seconds + self.args.ms_per_request * len(lines) / 1000
        prefix = "batch_" if api == "openai" else "msgbatch_"
        return Batch(prefix + uuid.uuid4().hex[:20], api, lines, now, now + seconds)

    # -- OpenAI -------------------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        raw = await request.body()
        head = f"Content-Type: {request.headers['content-type']}\r\n\r\n".encode()
        message = BytesParser(policy=HTTP).parsebytes(head + raw)
        data = b""
        for part in message.iter_parts():
            if part.get_param("name", header="content-disposition") == "file":
                payload = part.get_payload(decode=True)
                data = payload if isinstance(payload, bytes) else b""
        file_id = "file-" + uuid.uuid4().hex[:20]
        self.files[file_id] = data
        return JSONResponse(_file(file_id, len(data)))

    async def create(self, request: Request) -> Response:
        body = await request.json()
        now = time.time()
        lines = [json.loads(x) for x in self.files[body["input_file_id"]].splitlines() if x]
        batch = self.new("openai", lines, now)
        batch.metadata = body.get("metadata") or {}
        batch.tokens = sum(self.tokens(x["body"]) for x in lines)
        limit = self.args.enqueued_tokens
        if self.size("openai", now) + batch.tokens > limit:
            model = lines[0]["body"].get("model") if lines else None
            batch.refused = (
                f"Enqueued token limit reached for {model} in organization org-bench. Limit: "
                f"{limit:,} enqueued tokens. Please try submitting an equal or smaller batch "
                "once some of your batches have completed."
            )
            self.counts["refused"] += 1
        else:
            self.counts["submitted"] += len(lines)
        self.counts["creates"] += 1
        self.batches[batch.id] = batch
        self.note("openai", now)
        return JSONResponse(self.openai_json(batch, now))

    def openai_json(self, b: Batch, now: float) -> dict[str, Any]:
        if b.refused:
            status = "failed"
        elif now < b.ends:
            status = "in_progress"
        else:
            status = "completed"
            if b.output_file is None:
                b.output_file = self.results_file(b)
        errors = None
        if b.refused:
            error = {"code": "token_limit_exceeded", "message": b.refused, "param": None}
            errors = {"object": "list", "data": [{**error, "line": None}]}
        done = len(b.lines) if status == "completed" else 0
        return {
            "id": b.id,
            "object": "batch",
            "endpoint": "/v1/chat/completions",
            "errors": errors,
            "input_file_id": "",
            "completion_window": "24h",
            "status": status,
            "output_file_id": b.output_file,
            "error_file_id": None,
            "created_at": int(b.created),
            "expires_at": int(b.created + 86400),
            "request_counts": {"total": len(b.lines), "completed": done, "failed": 0},
            "metadata": b.metadata,
        }

    def results_file(self, b: Batch) -> str:
        out = []
        for x in b.lines:
            answer = {
                "id": "chatcmpl-bench",
                "object": "chat.completion",
                "created": int(b.ends),
                "model": x["body"].get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "billing"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": self.tokens(x["body"]), "completion_tokens": 1},
            }
            response = {"status_code": 200, "request_id": "req", "body": answer}
            out.append({"id": "r", "custom_id": x["custom_id"], "response": response})
        self.counts["processed"] += len(out)
        file_id = "file-" + uuid.uuid4().hex[:20]
        self.files[file_id] = "".join(json.dumps(o) + "\n" for o in out).encode()
        return file_id

    async def retrieve(self, request: Request) -> Response:
        self.counts["polls"] += 1
        return JSONResponse(self.openai_json(self.batches[request.path_params["id"]], time.time()))

    async def list_batches(self, request: Request) -> Response:
        now = time.time()
        found = [b for b in reversed(self.batches.values()) if b.api == "openai"][:100]
        data = [self.openai_json(b, now) for b in found]
        return JSONResponse({"object": "list", "data": data, "has_more": False})

    async def content(self, request: Request) -> Response:
        return Response(self.files[request.path_params["id"]])

    # -- Anthropic ----------------------------------------------------------------------------
    async def message_create(self, request: Request) -> Response:
        body = await request.json()
        now = time.time()
        lines = [{"custom_id": r["custom_id"], "body": r["params"]} for r in body["requests"]]
        limit = self.args.queued_requests
        if self.size("anthropic", now) + len(lines) > limit:
            self.counts["refused_429"] += 1
            error = {
                "type": "rate_limit_error",
                "message": "Too many batch requests are waiting in your workspace's processing "
                "queue. Please try again once some of your batches have ended.",
            }
            headers = {"retry-after": str(self.args.retry_after)}
            return JSONResponse({"type": "error", "error": error}, 429, headers=headers)
        batch = self.new("anthropic", lines, now)
        self.batches[batch.id] = batch
        self.counts["creates"] += 1
        self.counts["submitted"] += len(lines)
        self.note("anthropic", now)
        return JSONResponse(self.message_json(batch, now, request))

    def message_json(self, b: Batch, now: float, request: Request) -> dict[str, Any]:
        ended = now >= b.ends
        counts = dict.fromkeys(("processing", "succeeded", "errored", "canceled", "expired"), 0)
        counts["succeeded" if ended else "processing"] = len(b.lines)
        if ended and b.output_file is None:
            b.output_file = "done"
            self.counts["processed"] += len(b.lines)
        return {
            "id": b.id,
            "type": "message_batch",
            "processing_status": "ended" if ended else "in_progress",
            "request_counts": counts,
            "created_at": _iso(b.created),
            "expires_at": _iso(b.created + 86400),
            "ended_at": _iso(b.ends) if ended else None,
            "cancel_initiated_at": None,
            "archived_at": None,
            "results_url": f"{request.base_url}v1/messages/batches/{b.id}/results"
            if ended
            else None,
        }

    async def message_retrieve(self, request: Request) -> Response:
        self.counts["polls"] += 1
        batch = self.batches[request.path_params["id"]]
        return JSONResponse(self.message_json(batch, time.time(), request))

    async def message_list(self, request: Request) -> Response:
        now = time.time()
        found = [b for b in reversed(self.batches.values()) if b.api == "anthropic"][:100]
        data = [self.message_json(b, now, request) for b in found]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return JSONResponse({"data": data, "has_more": False, "first_id": first, "last_id": last})

    async def message_results(self, request: Request) -> Response:
        b = self.batches[request.path_params["id"]]
        out = []
        for x in b.lines:
            message = {
                "id": "msg_bench",
                "type": "message",
                "role": "assistant",
                "model": x["body"].get("model"),
                "content": [{"type": "text", "text": "billing"}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": self.tokens(x["body"]), "output_tokens": 1},
            }
            result = {"type": "succeeded", "message": message}
            out.append(json.dumps({"custom_id": x["custom_id"], "result": result}) + "\n")
        return Response("".join(out), media_type="application/binary")

    # -- figures ------------------------------------------------------------------------------
    async def stats(self, request: Request) -> Response:
        now = time.time()
        api = "openai" if any(b.api == "openai" for b in self.batches.values()) else "anthropic"
        limit = self.args.enqueued_tokens if api == "openai" else self.args.queued_requests
        self.note(api, now)
        accepted = [b for b in self.batches.values() if not b.refused]
        use = None
        if accepted:
            start = min(b.created for b in accepted)
            end = max(b.ends for b in accepted)
            # The queue's size is a step function: each step lasts until the next change or
            # until a batch in it ends, so integrate over every moment something changes.
            moments = sorted(
                {start, end, *(b.created for b in accepted), *(b.ends for b in accepted)}
            )
            area = 0.0
            for a, b in itertools.pairwise(moments):
                area += self._size_at(api, a) * (b - a)
            use = area / (limit * (end - start)) if end > start else None
        return JSONResponse(
            {
                **self.counts,
                "limit": limit,
                "peak": self.peak,
                "peak_use": self.peak / limit,
                "use": use,
                "batches": len(accepted),
            }
        )

    def _size_at(self, api: str, at: float) -> int:
        live = [
            b
            for b in self.batches.values()
            if b.api == api and not b.refused and b.created <= at < b.ends
        ]
        return sum(b.tokens if api == "openai" else len(b.lines) for b in live)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/files", self.upload, methods=["POST"]),
                Route("/v1/files/{id}/content", self.content, methods=["GET"]),
                Route("/v1/batches", self.create, methods=["POST"]),
                Route("/v1/batches", self.list_batches, methods=["GET"]),
                Route("/v1/batches/{id}", self.retrieve, methods=["GET"]),
                Route("/v1/messages/batches", self.message_create, methods=["POST"]),
                Route("/v1/messages/batches", self.message_list, methods=["GET"]),
                Route("/v1/messages/batches/{id}", self.message_retrieve, methods=["GET"]),
                Route("/v1/messages/batches/{id}/results", self.message_results, methods=["GET"]),
                Route("/stats", self.stats, methods=["GET"]),
            ]
        )


def _file(file_id: str, size: int) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": int(time.time()),
        "filename": "input.jsonl",
        "purpose": "batch",
        "status": "processed",
    }


def _iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1e6):06d}Z"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--enqueued-tokens", type=int, default=12_000)
    p.add_argument("--queued-requests", type=int, default=1_200)
    p.add_argument("--chars-per-token", type=float, default=4.0)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--ms-per-request", type=float, default=1.0)
    p.add_argument("--retry-after", type=int, default=1)
    args = p.parse_args()
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", args.port))
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}/v1", flush=True)
    config = uvicorn.Config(QueueProvider(args).app(), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
