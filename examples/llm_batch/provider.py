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
answers); result files are written as the providers write them. OpenAI: an output file of the
successes and an error file of per-request errors (``response.status_code`` 400 or 500) and, for
an expired batch, of its unrun requests (``error.code`` ``batch_expired``); a cancelled batch's
unrun requests are in neither file. Anthropic: one result per request (``succeeded``,
``errored``, ``canceled``, ``expired``). Both in an order shuffled by the seed, as neither
promises the order of the input.

Limits are refused with each API's error shape: an input file over 50,000 requests or 200 MB
(``400`` at upload), a message batch over 100,000 requests (``400``) or 256 MB (``413``).
A malformed input file makes the OpenAI batch ``failed`` after validation, with ``errors``.

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
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from email.message import Message
from email.parser import BytesHeaderParser
from pathlib import Path
from types import FrameType
from typing import Any, Final

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from examples.llm_batch.jobs import (
    CANCELLABLE,
    CHAT,
    EMBEDDINGS,
    ENDED,
    MESSAGES,
    Answerer,
    Job,
    ManualClock,
    Outcome,
    Phase,
    Settings,
    expires,
    jsonl,
)

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
DAY: Final = 24 * 3600
_DEFAULTS: Final = Settings()
_REPO: Final = str(Path(__file__).resolve().parents[2])
_CUSTOM_ID: Final = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_EXPIRED_REQUEST: Final = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}


class _Refused(Exception):
    """A call refused with ``status`` and the API's error ``kind`` (type) and message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class _File:
    def __init__(self, filename: str, purpose: str, data: bytes, created: float) -> None:
        self.id = f"file-{uuid.uuid4().hex[:24]}"
        self.filename, self.purpose, self.data, self.created = filename, purpose, data, created

    def json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": len(self.data),
            "created_at": int(self.created),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


class Provider:
    """The ASGI application: both batch APIs and ``/stats``.

    All state is touched from the server's event loop only, so it needs no lock. ``clock``
    gives the time (seconds since the epoch) that batches move by: ``time.time``, or a
    :class:`ManualClock` for a test that walks a batch through its states.
    """

    def __init__(self, settings: Settings = _DEFAULTS, clock: Callable[[], float] = time.time):
        self.settings, self.clock = settings, clock
        self.counts: Counter[str] = Counter()
        self.answerer = Answerer(settings, self.counts)
        self.files: dict[str, _File] = {}
        self.batches: dict[str, Job] = {}  # OpenAI's, in creation order
        self.message_batches: dict[str, Job] = {}  # Anthropic's, in creation order
        openai_routes = [
            Route("/v1/files", self._upload, methods=["POST"]),
            Route("/v1/files", self._list_files, methods=["GET"]),
            Route("/v1/files/{id}", self._file, methods=["GET"]),
            Route("/v1/files/{id}", self._delete_file, methods=["DELETE"]),
            Route("/v1/files/{id}/content", self._content, methods=["GET"]),
            Route("/v1/batches", self._create, methods=["POST"]),
            Route("/v1/batches", self._list, methods=["GET"]),
            Route("/v1/batches/{id}", self._retrieve, methods=["GET"]),
            Route("/v1/batches/{id}/cancel", self._cancel, methods=["POST"]),
        ]
        anthropic_routes = [
            Route("/v1/messages/batches", self._m_create, methods=["POST"]),
            Route("/v1/messages/batches", self._m_list, methods=["GET"]),
            Route("/v1/messages/batches/{id}", self._m_retrieve, methods=["GET"]),
            Route("/v1/messages/batches/{id}/cancel", self._m_cancel, methods=["POST"]),
            Route("/v1/messages/batches/{id}/results", self._m_results, methods=["GET"]),
        ]
        self._router = Router(
            routes=[
                *(self._answering(r, _openai_error) for r in openai_routes),
                *(self._answering(r, _anthropic_error) for r in anthropic_routes),
                Route("/stats", self._stats, methods=["GET"]),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._router(scope, receive, send)

    def snapshot(self) -> dict[str, int]:
        """What ``/stats`` returns, every batch brought up to now first."""
        now = self.clock()
        for job in [*self.batches.values(), *self.message_batches.values()]:
            self._settle(job, now)
        counts = {name: self.counts[name] for name in STATS}
        counts["polls"] = counts["retrieves"] + counts["lists"]
        return counts

    async def _stats(self, request: Request) -> Response:
        return JSONResponse(self.snapshot())

    def _answering(self, route: Route, error: Callable[[_Refused], Response]) -> Route:
        """``route`` with its refusals answered in the API's error shape, and counted."""
        endpoint = route.endpoint

        async def answered(request: Request) -> Response:
            try:
                response: Response = await endpoint(request)
            except _Refused as e:
                self.counts["refused"] += 1
                return error(e)
            return response

        return Route(route.path, answered, methods=route.methods)

    # -- a batch's state, either API -------------------------------------------------------------
    def _settle(self, job: Job, now: float) -> Phase:
        """Answer what is done by ``now``; once the batch has ended, count its unrun requests
        and write an OpenAI batch's files (both once)."""
        job.advance(now, self.answerer)
        phase = job.phase(now)
        if phase in ENDED and not job.settled:
            job.settled = True
            unrun = len(job.requests) - len(job.outcomes) if not job.problems else 0
            if phase is Phase.EXPIRED:
                self.counts["expired"] += unrun
            elif phase is Phase.CANCELLED:
                self.counts["cancelled"] += unrun
            if job.endpoint != MESSAGES:
                self._write_files(job, phase)
        return phase

    def _write_files(self, job: Job, phase: Phase) -> None:
        output: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        for o in job.outcomes:
            line = {"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": o.custom_id}
            response = {"status_code": o.status, "request_id": "req_" + uuid.uuid4().hex[:24]}
            if o.error is None:
                output.append({**line, "response": {**response, "body": o.body}, "error": None})
            else:
                kind, message = o.error
                body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
                errors.append({**line, "response": {**response, "body": body}, "error": None})
        if phase is Phase.EXPIRED:
            errors += [
                {"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": custom_id}
                | {"response": None, "error": _EXPIRED_REQUEST}
                for custom_id, _ in job.requests[len(job.outcomes) :]
            ]
        for name, lines in (("output", output), ("error", errors)):
            if lines:
                data = jsonl(self._shuffled(job, lines))
                file = _File(f"{job.id}_{name}.jsonl", "batch_output", data, job.ended_at())
                self.files[file.id] = file
                job.files[name] = file.id

    def _shuffled(self, job: Job, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        random.Random(f"{self.settings.seed}:{job.id}").shuffle(lines)
        return lines

    def _job(self, jobs: dict[str, Job], request: Request, what: str) -> Job:
        batch_id = request.path_params["id"]
        if batch_id not in jobs:
            raise _Refused(404, f"No {what} found with id '{batch_id}'.", "not_found_error")
        return jobs[batch_id]

    # -- OpenAI: files ---------------------------------------------------------------------------
    async def _upload(self, request: Request) -> Response:
        form = _multipart(await request.body(), request.headers.get("content-type", ""))
        purpose, upload = form.get("purpose"), form.get("file")
        filename, data = upload or (None, b"")
        if filename is None or purpose is None:
            raise _Refused(400, "expected a multipart form with 'file' and 'purpose'")
        if purpose[1] != b"batch":
            raise _Refused(
                400, "this local provider keeps batch input files only: upload with purpose='batch'"
            )
        if not filename.endswith(".jsonl"):
            raise _Refused(400, f"Invalid file format for Batch API: {filename!r}. Must be .jsonl")
        s = self.settings
        if len(data) > s.openai_max_bytes:
            raise _Refused(
                400,
                f"File {filename!r} is {len(data):,} bytes; a batch input file may be at most "
                f"{s.openai_max_bytes:,} bytes. Split its requests across several batches.",
            )
        lines = sum(1 for line in data.splitlines() if line.strip())
        if lines > s.openai_max_requests:
            raise _Refused(
                400,
                f"File {filename!r} holds {lines:,} requests; a batch may hold at most "
                f"{s.openai_max_requests:,}. Split its requests across several batches.",
            )
        file = _File(filename, "batch", data, self.clock())
        self.files[file.id] = file
        self.counts["uploads"] += 1
        return JSONResponse(file.json())

    def _the_file(self, request: Request) -> _File:
        file_id = request.path_params["id"]
        if file_id not in self.files:
            raise _Refused(404, f"No such File object: {file_id}", "invalid_request_error")
        return self.files[file_id]

    async def _file(self, request: Request) -> Response:
        file = self._the_file(request)
        self.counts["retrieves"] += 1
        return JSONResponse(file.json())

    async def _list_files(self, request: Request) -> Response:
        purpose = request.query_params.get("purpose")
        files = [f for f in self.files.values() if purpose in (None, f.purpose)]
        if request.query_params.get("order", "desc") == "desc":
            files.reverse()
        page, has_more = _page(files, request.query_params.get("after"), _limit(request, 10_000))
        self.counts["lists"] += 1
        return JSONResponse(_list_json([f.json() for f in page], has_more))

    async def _content(self, request: Request) -> Response:
        file = self._the_file(request)
        self.counts["downloads"] += 1
        return Response(file.data, media_type="application/octet-stream")

    async def _delete_file(self, request: Request) -> Response:
        file = self._the_file(request)
        del self.files[file.id]
        self.counts["deletes"] += 1
        return JSONResponse({"id": file.id, "object": "file", "deleted": True})

    # -- OpenAI: batches -------------------------------------------------------------------------
    async def _create(self, request: Request) -> Response:
        body = _json_object(await request.body())
        endpoint, file_id = body.get("endpoint"), body.get("input_file_id")
        if endpoint not in (CHAT, EMBEDDINGS):
            raise _Refused(
                400, f"endpoint must be {CHAT!r} or {EMBEDDINGS!r} here, got {endpoint!r}"
            )
        if body.get("completion_window") != "24h":
            raise _Refused(400, "completion_window must be '24h'")
        metadata = body.get("metadata")
        if metadata is not None and not _metadata_ok(metadata):
            raise _Refused(
                400,
                "metadata must be at most 16 string pairs, keys up to 64 "
                "characters, values up to 512",
            )
        if file_id not in self.files or self.files[file_id].purpose != "batch":
            raise _Refused(400, f"Invalid 'input_file_id': no batch input file {file_id!r}")
        requests, problems = _read_input(self.files[file_id].data, endpoint)
        now = self.clock()
        job = Job(
            id=f"batch_{uuid.uuid4().hex[:24]}",
            endpoint=endpoint,
            requests=requests,
            created=now,
            settings=self.settings,
            expiring=not problems and expires(self.settings, "openai", len(self.batches) + 1),
            problems=problems,
            metadata=metadata,
            input_file_id=file_id,
        )
        self.batches[job.id] = job
        self.counts["creates"] += 1
        self.counts["submitted"] += 0 if problems else len(requests)
        return JSONResponse(self._batch_json(job, now))

    async def _retrieve(self, request: Request) -> Response:
        job = self._job(self.batches, request, "batch")
        self.counts["retrieves"] += 1
        return JSONResponse(self._batch_json(job, self.clock()))

    async def _list(self, request: Request) -> Response:
        jobs = list(reversed(self.batches.values()))
        page, has_more = _page(jobs, request.query_params.get("after"), _limit(request, 100))
        self.counts["lists"] += 1
        now = self.clock()
        return JSONResponse(_list_json([self._batch_json(j, now) for j in page], has_more))

    async def _cancel(self, request: Request) -> Response:
        job = self._job(self.batches, request, "batch")
        now = self.clock()
        phase = self._settle(job, now)
        if phase not in CANCELLABLE:
            raise _Refused(400, f"Cannot cancel a batch with status '{phase}'.")
        job.cancelled_at = now
        self.counts["cancels"] += 1
        return JSONResponse(self._batch_json(job, now))

    def _batch_json(self, job: Job, now: float) -> dict[str, Any]:
        phase = self._settle(job, now)
        s, at = self.settings, job.created
        started = not job.problems and now - at > s.validating_seconds
        finalizing = at + s.validating_seconds + s.processing_delay
        ok = [o for o in job.outcomes if o.error is None]
        failed = len(job.outcomes) - len(ok)
        if phase is Phase.EXPIRED:
            failed += len(job.requests) - len(job.outcomes)
        tokens_in, tokens_out = (sum(o.tokens[i] for o in ok) for i in (0, 1))
        models = [b.get("model") for _, b in job.requests[:1] if isinstance(b, dict)]
        return {
            "id": job.id,
            "object": "batch",
            "endpoint": job.endpoint,
            "model": models[0] if models else None,
            "errors": {"object": "list", "data": job.problems} if job.problems else None,
            "input_file_id": job.input_file_id,
            "completion_window": "24h",
            "status": str(phase),
            "output_file_id": job.files.get("output"),
            "error_file_id": job.files.get("error"),
            "created_at": int(at),
            "in_progress_at": int(at + s.validating_seconds) if started else None,
            "expires_at": int(at + DAY),
            "finalizing_at": _when(phase in (Phase.FINALIZING, Phase.COMPLETED), finalizing),
            "completed_at": _when(phase is Phase.COMPLETED, job.ended_at()),
            "failed_at": _when(phase is Phase.FAILED, job.ended_at()),
            "expired_at": _when(phase is Phase.EXPIRED, job.ended_at()),
            "cancelling_at": _when(job.cancelled_at is not None, job.cancelled_at or 0),
            "cancelled_at": _when(phase is Phase.CANCELLED, job.ended_at()),
            "request_counts": {"total": len(job.requests), "completed": len(ok), "failed": failed},
            "metadata": job.metadata,
            "usage": {
                "input_tokens": tokens_in,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": tokens_out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": tokens_in + tokens_out,
            },
        }

    # -- Anthropic: message batches --------------------------------------------------------------
    async def _m_create(self, request: Request) -> Response:
        raw, s = await request.body(), self.settings
        if len(raw) > s.anthropic_max_bytes:
            raise _Refused(
                413,
                f"Request is {len(raw):,} bytes; a message batch may be at most "
                f"{s.anthropic_max_bytes:,} bytes. Split its requests across several batches.",
                "request_too_large",
            )
        requests = _json_object(raw).get("requests")
        if not isinstance(requests, list) or not requests:
            raise _Refused(400, "requests: expected a non-empty list")
        if len(requests) > s.anthropic_max_requests:
            raise _Refused(
                400,
                f"requests: {len(requests):,} requests; a message batch may hold at most "
                f"{s.anthropic_max_requests:,}. Split them across several batches.",
            )
        pairs: list[tuple[str, Any]] = []
        for i, r in enumerate(requests):
            r = r if isinstance(r, dict) else {}
            custom_id, params = r.get("custom_id"), r.get("params")
            if not (isinstance(custom_id, str) and _CUSTOM_ID.fullmatch(custom_id)):
                raise _Refused(
                    400,
                    f"requests.{i}.custom_id: must match "
                    f"^[a-zA-Z0-9_-]{{1,64}}$, got {custom_id!r}",
                )
            if not isinstance(params, dict):
                raise _Refused(400, f"requests.{i}.params: expected an object")
            pairs.append((custom_id, params))
        ids = [c for c, _ in pairs]
        if len(set(ids)) < len(ids):
            raise _Refused(400, "requests: each custom_id must be unique within the batch")
        now = self.clock()
        job = Job(
            id=f"msgbatch_{uuid.uuid4().hex[:24]}",
            endpoint=MESSAGES,
            requests=pairs,
            created=now,
            settings=s,
            expiring=expires(s, "anthropic", len(self.message_batches) + 1),
        )
        self.message_batches[job.id] = job
        self.counts["creates"] += 1
        self.counts["submitted"] += len(pairs)
        return JSONResponse(self._message_batch_json(job, now, request))

    async def _m_retrieve(self, request: Request) -> Response:
        job = self._job(self.message_batches, request, "message batch")
        self.counts["retrieves"] += 1
        return JSONResponse(self._message_batch_json(job, self.clock(), request))

    async def _m_list(self, request: Request) -> Response:
        jobs = list(reversed(self.message_batches.values()))
        after, before = request.query_params.get("after_id"), request.query_params.get("before_id")
        limit = _limit(request, 1000)
        if before is not None:
            end = _index(jobs, before)
            start = max(0, end - limit)
            page, has_more = jobs[start:end], start > 0
        else:
            page, has_more = _page(jobs, after, limit)
        self.counts["lists"] += 1
        now = self.clock()
        return JSONResponse(
            {
                "data": [self._message_batch_json(j, now, request) for j in page],
                "has_more": has_more,
                "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None,
            }
        )

    async def _m_cancel(self, request: Request) -> Response:
        job = self._job(self.message_batches, request, "message batch")
        now = self.clock()
        if self._settle(job, now) not in CANCELLABLE:
            raise _Refused(400, f"Message batch {job.id} has ended; it cannot be canceled.")
        job.cancelled_at = now
        self.counts["cancels"] += 1
        return JSONResponse(self._message_batch_json(job, now, request))

    async def _m_results(self, request: Request) -> Response:
        job = self._job(self.message_batches, request, "message batch")
        phase = self._settle(job, self.clock())
        if phase not in ENDED:
            raise _Refused(
                400,
                f"Message batch {job.id} is still processing; its results are available once "
                "processing_status is 'ended'.",
            )
        lines = [{"custom_id": o.custom_id, "result": _m_result(o)} for o in job.outcomes]
        unrun = "expired" if phase is Phase.EXPIRED else "canceled"
        lines += [
            {"custom_id": custom_id, "result": {"type": unrun}}
            for custom_id, _ in job.requests[len(job.outcomes) :]
        ]
        self.counts["downloads"] += 1
        return Response(jsonl(self._shuffled(job, lines)), media_type="application/x-jsonl")

    def _message_batch_json(self, job: Job, now: float, request: Request) -> dict[str, Any]:
        phase = self._settle(job, now)
        ended = phase in ENDED
        counts = dict.fromkeys(("processing", "succeeded", "errored", "canceled", "expired"), 0)
        if ended:
            counts["succeeded"] = sum(o.error is None for o in job.outcomes)
            counts["errored"] = len(job.outcomes) - counts["succeeded"]
            unrun = "expired" if phase is Phase.EXPIRED else "canceled"
            counts[unrun] = len(job.requests) - len(job.outcomes)
        else:
            counts["processing"] = len(job.requests)
        status = "ended" if ended else "canceling" if phase is Phase.CANCELLING else "in_progress"
        results = f"{request.base_url}v1/messages/batches/{job.id}/results"
        cancelled = job.cancelled_at
        return {
            "id": job.id,
            "type": "message_batch",
            "processing_status": status,
            "request_counts": counts,
            "created_at": _iso(job.created),
            "expires_at": _iso(job.created + DAY),
            "ended_at": _iso(job.ended_at()) if ended else None,
            "cancel_initiated_at": _iso(cancelled) if cancelled is not None else None,
            "archived_at": None,
            "results_url": results if ended else None,
        }


# -- each API's error shape ----------------------------------------------------------------------
def _openai_error(e: _Refused) -> Response:
    error = {"message": e.message, "type": "invalid_request_error", "param": None, "code": None}
    return JSONResponse({"error": error}, status_code=e.status)


def _anthropic_error(e: _Refused) -> Response:
    body = {"type": "error", "error": {"type": e.kind, "message": e.message}}
    return JSONResponse(body, status_code=e.status)


def _m_result(outcome: Outcome) -> dict[str, Any]:
    if outcome.error is None:
        return {"type": "succeeded", "message": outcome.body}
    kind, message = outcome.error
    kind = "api_error" if outcome.status >= 500 else kind
    error = {"type": "error", "error": {"type": kind, "message": message}}
    return {"type": "errored", "error": error}


# -- reading what was sent -----------------------------------------------------------------------
def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise _Refused(400, "expected a JSON object as the request body")
    return body


def _multipart(body: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """The fields of a multipart/form-data body: name -> (filename or None, bytes)."""
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_boundary()
    if not content_type.startswith("multipart/form-data") or not boundary:
        raise _Refused(400, "expected a multipart/form-data body")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in body.split(b"--" + boundary.encode())[1:-1]:
        head, _, data = part.partition(b"\r\n\r\n")
        headers = BytesHeaderParser().parsebytes(head.strip(b"\r\n") + b"\r\n")
        name = headers.get_param("name", header="content-disposition")
        if isinstance(name, str):
            fields[name] = (headers.get_filename(), data.removesuffix(b"\r\n"))
    return fields


def _read_input(data: bytes, endpoint: str) -> tuple[list[tuple[str, Any]], list[dict[str, Any]]]:
    """A batch input file's requests, and its problems as OpenAI's batch ``errors`` list."""
    requests: list[tuple[str, Any]] = []
    problems: list[dict[str, Any]] = []
    seen: set[str] = set()
    models: set[Any] = set()
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        problem = _line_problem(line, endpoint, seen)
        if isinstance(problem, tuple):
            code, message = problem
            problems.append({"code": code, "message": message, "param": None, "line": number})
            continue
        requests.append((problem["custom_id"], problem["body"]))
        seen.add(problem["custom_id"])
        models.add(problem["body"].get("model"))
    if len(models) > 1:
        message = (
            f"every request of a batch must use the same model; got {sorted(map(str, models))}"
        )
        problems.append(
            {"code": "mismatched_model", "message": message, "param": "body.model", "line": None}
        )
    if not requests and not problems:
        problems.append(
            {
                "code": "empty_file",
                "message": "the input file holds no requests",
                "param": None,
                "line": None,
            }
        )
    return requests, problems


def _line_problem(line: bytes, endpoint: str, seen: set[str]) -> tuple[str, str] | dict[str, Any]:
    """The request of one line, or its problem as ``(code, message)``."""
    try:
        request = json.loads(line)
    except ValueError:
        return "invalid_json_line", "This line is not valid JSON."
    if not isinstance(request, dict):
        return "invalid_json_line", "This line is not a JSON object."
    custom_id, body = request.get("custom_id"), request.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_required_parameter", "Missing or invalid 'custom_id'."
    if custom_id in seen:
        return "duplicate_custom_id", f"The custom_id {custom_id!r} is used more than once."
    if request.get("method") != "POST":
        return "invalid_method", "The method of every request must be 'POST'."
    if request.get("url") != endpoint:
        return "mismatched_endpoint", f"The url of every request must be the batch's {endpoint!r}."
    if not isinstance(body, dict):
        return "missing_required_parameter", "Missing or invalid 'body'."
    return request


def _limit(request: Request, most: int) -> int:
    text = request.query_params.get("limit", "20")
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise _Refused(400, f"limit must be an integer from 1 to {most}, got {text!r}")
    return int(text)


def _index(items: list[Any], item_id: str) -> int:
    for i, item in enumerate(items):
        if item.id == item_id:
            return i
    raise _Refused(400, f"no object with id {item_id!r} to page from", "invalid_request_error")


def _page(items: list[Any], after: str | None, limit: int) -> tuple[list[Any], bool]:
    """The ``limit`` items after the one with id ``after`` (from the start without), and whether
    more follow."""
    start = 0 if after is None else _index(items, after) + 1
    return items[start : start + limit], start + limit < len(items)


def _list_json(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _metadata_ok(metadata: Any) -> bool:
    return (
        isinstance(metadata, dict)
        and len(metadata) <= 16
        and all(isinstance(k, str) and len(k) <= 64 for k in metadata)
        and all(isinstance(v, str) and len(v) <= 512 for v in metadata.values())
    )


def _when(happened: bool, at: float) -> int | None:
    return int(at) if happened else None


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


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
