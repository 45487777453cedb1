"""OpenAI's Files and Batch API for the local provider, in the shapes the ``openai`` client
parses (``types/file_object.py``, ``types/batch.py``).

A batch's input file is uploaded (multipart, ``purpose=batch``, a ``.jsonl`` of
``{custom_id, method, url, body}`` lines; over 50,000 requests or 200 MB is refused at upload) and
read when the batch is created; a malformed line (not JSON, no ``custom_id`` or ``body``, a
repeated ``custom_id``, another ``url`` or method) or mixed models make the batch ``failed``
after validation, with ``errors`` naming the lines. Once a batch ends its files are written:
an output file of the successes and an error file of the per-request errors (``400``, ``500``)
and, for an expired batch, of its unrun requests (``error.code`` ``batch_expired``, no
``response``); a cancelled batch's unrun requests are in neither file. With
``openai_enqueued_tokens`` set, a batch whose input tokens would take the batches of its model
that have not ended past it fails validation with ``token_limit_exceeded``, its message stating
the limit, as OpenAI's enqueued token limit.
"""

from __future__ import annotations

import uuid
from email.message import Message
from email.parser import BytesHeaderParser
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from examples.llm_batch.common import (
    DAY,
    Ledger,
    Refused,
    answering,
    json_object,
    limit,
    page,
    prompt_tokens,
    waiting,
)
from examples.llm_batch.jobs import CANCELLABLE, CHAT, EMBEDDINGS, Job, Phase, expires, jsonl

_EXPIRED_REQUEST: Final = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}


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


class OpenAIBatchAPI:
    """The routes of ``/v1/files`` and ``/v1/batches`` on the provider's ``ledger``."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger, self.counts, self.settings = ledger, ledger.counts, ledger.settings
        self.files: dict[str, _File] = {}

    def routes(self) -> list[Route]:
        routes = [
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
        return [answering(r, _error, self.counts) for r in routes]

    # -- files -----------------------------------------------------------------------------------
    async def _upload(self, request: Request) -> Response:
        form = _multipart(await request.body(), request.headers.get("content-type", ""))
        purpose, upload = form.get("purpose"), form.get("file")
        filename, data = upload or (None, b"")
        if filename is None or purpose is None:
            raise Refused(400, "expected a multipart form with 'file' and 'purpose'")
        if purpose[1] != b"batch":
            raise Refused(400, "'purpose' must be 'batch': the provider keeps batch inputs only")
        if not filename.endswith(".jsonl"):
            raise Refused(400, f"Invalid file format for Batch API: {filename!r}. Must be .jsonl")
        s = self.settings
        if len(data) > s.openai_max_bytes:
            raise Refused(
                400,
                f"File {filename!r} is {len(data):,} bytes; a batch input file may be at most "
                f"{s.openai_max_bytes:,} bytes. Split its requests across several batches.",
            )
        lines = sum(1 for line in data.splitlines() if line.strip())
        if lines > s.openai_max_requests:
            raise Refused(
                400,
                f"File {filename!r} holds {lines:,} requests; a batch may hold at most "
                f"{s.openai_max_requests:,}. Split its requests across several batches.",
            )
        file = _File(filename, "batch", data, self.ledger.clock())
        self.files[file.id] = file
        self.counts["uploads"] += 1
        return JSONResponse(file.json())

    def _the_file(self, request: Request) -> _File:
        file_id = request.path_params["id"]
        if file_id not in self.files:
            raise Refused(404, f"No such File object: {file_id}")
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
        shown, has_more = page(files, request.query_params.get("after"), limit(request, 10_000))
        self.counts["lists"] += 1
        return JSONResponse(_list([f.json() for f in shown], has_more))

    async def _content(self, request: Request) -> Response:
        file = self._the_file(request)
        self.counts["downloads"] += 1
        return Response(file.data, media_type="application/octet-stream")

    async def _delete_file(self, request: Request) -> Response:
        file = self._the_file(request)
        del self.files[file.id]
        self.counts["deletes"] += 1
        return JSONResponse({"id": file.id, "object": "file", "deleted": True})

    # -- batches ---------------------------------------------------------------------------------
    async def _create(self, request: Request) -> Response:
        body = json_object(await request.body())
        endpoint, file_id = body.get("endpoint"), body.get("input_file_id")
        if endpoint not in (CHAT, EMBEDDINGS):
            raise Refused(400, f"endpoint must be {CHAT!r} or {EMBEDDINGS!r}, not {endpoint!r}")
        if body.get("completion_window") != "24h":
            raise Refused(400, "completion_window must be '24h'")
        metadata = body.get("metadata")
        if metadata is not None and not _metadata_ok(metadata):
            raise Refused(
                400, "metadata: at most 16 string pairs, keys to 64 characters, values to 512"
            )
        if file_id not in self.files or self.files[file_id].purpose != "batch":
            raise Refused(400, f"Invalid 'input_file_id': no batch input file {file_id!r}")
        requests, problems = _read_input(self.files[file_id].data, endpoint)
        now, batches = self.ledger.clock(), self.ledger.batches
        enqueued = sum(prompt_tokens(b) for _, b in requests)
        if not problems and self.settings.openai_enqueued_tokens:
            problems = self._queue_full(requests, enqueued)
        if not problems and self.settings.refuses(self.counts):
            problems = _token_limit(_model_of(requests), 2_000_000)
        job = Job(
            id=f"batch_{uuid.uuid4().hex[:24]}",
            endpoint=endpoint,
            requests=requests,
            created=now,
            settings=self.settings,
            expiring=not problems and expires(self.settings, "openai", len(batches) + 1),
            problems=problems,
            metadata=metadata,
            input_file_id=file_id,
            on_end=self._write_files,
            enqueued=0 if problems else enqueued,
        )
        batches[job.id] = job
        used = sum(j.enqueued for j in waiting(batches, self.ledger))
        self.counts["enqueued_peak"] = max(self.counts["enqueued_peak"], used)
        self.counts["creates"] += 1
        self.counts["submitted"] += 0 if problems else len(requests)
        return JSONResponse(self._json(job, now))

    def _queue_full(self, requests: list[tuple[str, Any]], enqueued: int) -> list[dict[str, Any]]:
        """The validation error of a batch past the enqueued token limit (none if it fits)."""
        limit_ = self.settings.openai_enqueued_tokens
        model = _model_of(requests)
        same = [j for j in waiting(self.ledger.batches, self.ledger) if _model(j) == model]
        if sum(j.enqueued for j in same) + enqueued <= limit_:
            return []
        self.counts["queue_refused"] += 1
        return _token_limit(model, limit_)

    async def _retrieve(self, request: Request) -> Response:
        job = self.ledger.find(self.ledger.batches, request, "batch")
        self.counts["retrieves"] += 1
        return JSONResponse(self._json(job, self.ledger.clock()))

    async def _list(self, request: Request) -> Response:
        jobs = list(reversed(self.ledger.batches.values()))
        shown, has_more = page(jobs, request.query_params.get("after"), limit(request, 100))
        self.counts["lists"] += 1
        now = self.ledger.clock()
        return JSONResponse(_list([self._json(j, now) for j in shown], has_more))

    async def _cancel(self, request: Request) -> Response:
        job = self.ledger.find(self.ledger.batches, request, "batch")
        now = self.ledger.clock()
        phase = self.ledger.settle(job, now)
        if phase not in CANCELLABLE:
            raise Refused(400, f"Cannot cancel a batch with status '{phase}'.")
        job.cancelled_at = now
        self.counts["cancels"] += 1
        return JSONResponse(self._json(job, now))

    def _json(self, job: Job, now: float) -> dict[str, Any]:
        phase = self.ledger.settle(job, now)
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

    def _write_files(self, job: Job, phase: Phase) -> None:
        """The output and error files of a batch that has ended (see the module docstring)."""
        output: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        for o in job.outcomes:
            line = {"id": _request_id("batch_req_"), "custom_id": o.custom_id}
            response = {"status_code": o.status, "request_id": _request_id("req_")}
            if o.error is None:
                output.append({**line, "response": {**response, "body": o.body}, "error": None})
            else:
                kind, message = o.error
                body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
                errors.append({**line, "response": {**response, "body": body}, "error": None})
        if phase is Phase.EXPIRED:
            errors += [
                {"id": _request_id("batch_req_"), "custom_id": custom_id, "response": None}
                | {"error": _EXPIRED_REQUEST}
                for custom_id, _ in job.requests[len(job.outcomes) :]
            ]
        for name, lines in (("output", output), ("error", errors)):
            if lines:
                data = jsonl(self.ledger.shuffled(job, lines))
                file = _File(f"{job.id}_{name}.jsonl", "batch_output", data, job.ended_at())
                self.files[file.id] = file
                job.files[name] = file.id


def _model(job: Job) -> Any:
    return next((b.get("model") for _, b in job.requests[:1] if isinstance(b, dict)), None)


def _error(e: Refused) -> Response:
    error = {"message": e.message, "type": "invalid_request_error", "param": None, "code": None}
    return JSONResponse({"error": error}, status_code=e.status)


def _request_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _multipart(body: bytes, content_type: str) -> dict[str, tuple[str | None, bytes]]:
    """The fields of a multipart/form-data body: name -> (filename or None, bytes)."""
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_boundary()
    if not content_type.startswith("multipart/form-data") or not boundary:
        raise Refused(400, "expected a multipart/form-data body")
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
        request = _line(line, endpoint, seen)
        if isinstance(request, tuple):
            code, message = request
            problems.append({"code": code, "message": message, "param": None, "line": number})
            continue
        requests.append((request["custom_id"], request["body"]))
        seen.add(request["custom_id"])
        models.add(request["body"].get("model"))
    if len(models) > 1:
        message = f"every request of a batch must use one model; got {sorted(map(str, models))}"
        problems.append({"code": "mismatched_model", "message": message, "param": "body.model"})
    if not requests and not problems:
        problems.append({"code": "empty_file", "message": "the input file holds no requests"})
    return requests, problems


def _line(line: bytes, endpoint: str, seen: set[str]) -> tuple[str, str] | dict[str, Any]:
    """The request of one line, or its problem as ``(code, message)``."""
    try:
        request = json_object(line)
    except Refused:
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


def _list(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
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


def _model_of(requests: list[tuple[str, Any]]) -> Any:
    return next((b.get("model") for _, b in requests if isinstance(b, dict)), None)


def _token_limit(model: Any, limit: int) -> list[dict[str, Any]]:
    """A batch's validation error past the enqueued token limit of ``model``, as OpenAI's."""
    message = (
        f"Enqueued token limit reached for {model} in organization org-local. Limit: "
        f"{limit:,} enqueued tokens. Please try submitting an equal or smaller batch once "
        "some of your batches have completed."
    )
    return [{"code": "token_limit_exceeded", "message": message, "param": None, "line": None}]
