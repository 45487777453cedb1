"""A fake of Google's Gemini API and of Vertex AI's batch prediction, on 127.0.0.1, written from
Google's documentation and from the requests the ``google-genai`` client sends.

One server speaks both:

- the Gemini API (``/v1beta``): ``models/{m}:generateContent``, Batch Mode
  (``models/{m}:batchGenerateContent``; ``batches`` get, list, ``:cancel``) with inline requests
  (``metadata.key``) answered inline and JSONL files (``{"key", "request"}``) answered as a
  responses file; the Files API's resumable upload (``/upload/v1beta/files``), get and download
  (``files/{id}:download?alt=media``);
- Vertex AI (``/v1/projects/{p}/locations/{l}``): ``publishers/google/models/{m}:generateContent``
  and ``batchPredictionJobs`` (create, get, list with a ``display_name`` filter, ``:cancel``),
  reading its JSONL input from Cloud Storage and writing ``predictions.jsonl`` beside it (on
  fake-gcs-server, through gcsfs);
- ``/token``: an OAuth token endpoint, so that a service account's key file (application
  default credentials) gets its access token here.

A job is PENDING for ``pending_seconds``, RUNNING for ``running_seconds``, then SUCCEEDED: its
requests are answered then, once (each answer counts in ``processed``, by the request's text in
``texts``, so a row paid twice shows as ``paid_twice``). The first ``expire_jobs`` jobs end
EXPIRED instead, with the first half of their requests answered; a cancel ends a job CANCELLED
the same way. ``error_every`` answers every n-th request (by the last number in its text) with
a transient error, the first time it is sent.
Online, ``rate_limit_every`` answers every n-th ``generateContent`` with 429
``RESOURCE_EXHAUSTED`` and a ``retryDelay`` of ``retry_delay`` seconds; a refused request sent
again before its delay has passed counts in ``early``.

The answer is the ticket's category: ``billing`` for a text with "charged" or "refund",
``technical`` for "crash" or "error", else ``other``.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from examples import serving

# The API versions a client may name: the Gemini API's v1 and v1beta, Vertex AI's v1 and v1beta1.
V = "(?:v1|v1beta|v1beta1)"


@dataclass
class Settings:
    pending_seconds: float = 0.05
    running_seconds: float = 0.1
    expire_jobs: int = 0
    error_every: int = 0
    rate_limit_every: int = 0
    retry_delay: float = 0.5
    storage_options: dict[str, Any] = field(default_factory=dict)  # gcsfs's, for Vertex jobs


@dataclass
class Job:
    name: str
    display_name: str
    model: str
    created: float
    vertex: bool
    requests: list[dict[str, Any]] = field(default_factory=list)  # {"key"?, "request"} each
    inline: bool = False
    number: int = 0  # the order of its creation, from 1
    output_prefix: str = ""
    state: str = ""  # set once the job has ended
    output: dict[str, Any] = field(default_factory=dict)
    output_directory: str = ""
    stats: dict[str, int] = field(default_factory=dict)


def answer(text: str) -> str:
    lowered = text.lower()
    if "charged" in lowered or "refund" in lowered:
        return "billing"
    if "crash" in lowered or "error" in lowered:
        return "technical"
    return "other"


def _text(request: dict[str, Any]) -> str:
    return " ".join(
        str(part.get("text", ""))
        for content in request.get("contents") or []
        for part in content.get("parts") or []
    )


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


def _response(request: dict[str, Any], model: str) -> dict[str, Any]:
    text = _text(request)
    prompt = max(1, len(text) // 4)
    return {
        "candidates": [
            {
                "content": {"role": "model", "parts": [{"text": answer(text)}]},
                "finishReason": "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {
            "promptTokenCount": prompt,
            "candidatesTokenCount": 1,
            "totalTokenCount": prompt + 1,
        },
        "modelVersion": model,
    }


def _error(code: int, status: str, message: str, **extra: Any) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "status": status, **extra}}
    return JSONResponse(body, status_code=code)


class Fake:
    """The fake's state and its ASGI app (``app``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.lock = threading.Lock()
        self.ending = threading.Lock()  # one job ends at a time: its requests answered once
        self.jobs: dict[str, Job] = {}
        self.files: dict[str, bytes] = {}
        self.uploads: dict[str, dict[str, Any]] = {}
        self.counts: Counter[str] = Counter()
        self.texts: Counter[str] = Counter()  # answers paid, by the request's text
        self.failed: set[str] = set()  # texts answered with an error once
        self.online_calls = 0
        self.refused_until: dict[str, float] = {}  # a refused request's text: its retry time
        self.numbers = itertools.count(1)
        self.app = Starlette(
            routes=[
                Route("/stats", self.stats, methods=["GET"]),
                Route("/token", self.token, methods=["POST"]),
                Route("/{path:path}", self.dispatch, methods=["GET", "POST", "DELETE"]),
            ]
        )
        self.base = ""

    # -- bookkeeping -------------------------------------------------------------------------
    async def stats(self, request: Request) -> JSONResponse:
        return JSONResponse(self.snapshot())

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            twice = sum(1 for n in self.texts.values() if n > 1)
            return {**self.counts, "paid_twice": twice, "paid_texts": len(self.texts)}

    async def token(self, request: Request) -> JSONResponse:
        self.counts["tokens"] += 1
        token = {"access_token": "fake-token", "expires_in": 3600, "token_type": "Bearer"}
        return JSONResponse(token)

    def _pay(self, request: dict[str, Any]) -> None:
        self.counts["processed"] += 1
        self.texts[_text(request)] += 1

    def _fails(self, request: dict[str, Any]) -> bool:
        """Whether the request fails this time: every ``error_every``-th text, once."""
        every = self.settings.error_every
        text = _text(request)
        numbers = re.findall(r"\d+", text)
        if not (every and numbers and int(numbers[-1]) % every == every - 1):
            return False
        failed = text in self.failed
        self.failed.add(text)
        return not failed

    # -- routing -----------------------------------------------------------------------------
    async def dispatch(self, request: Request) -> Response:
        path = "/" + request.path_params["path"]
        method = request.method
        raw = await request.body()
        shape = re.sub(r"[0-9a-f]{8,}|\d+", "*", path)
        with self.lock:
            self.counts[f"{method} {shape}"] += 1
        try:
            return self._route(method, path, request, raw)
        except KeyError as e:
            return _error(404, "NOT_FOUND", f"not found: {e}")

    def _route(self, method: str, path: str, request: Request, raw: bytes) -> Response:
        m = re.fullmatch(rf"/{V}/models/([^/:]+):(generateContent|batchGenerateContent)", path)
        if m and method == "POST":
            if m.group(2) == "generateContent":
                return self._generate(json.loads(raw), m.group(1))
            return self._gemini_create(json.loads(raw), m.group(1))
        m = re.fullmatch(rf"/{V}/batches/([^/:]+)(:cancel)?", path)
        if m:
            if m.group(2):
                return self._cancel(f"batches/{m.group(1)}")
            return JSONResponse(self._operation(self.jobs[f"batches/{m.group(1)}"]))
        if re.fullmatch(rf"/{V}/batches", path):
            return self._list(request, vertex=False)
        if re.fullmatch(rf"/upload/{V}/files", path):
            return self._upload(request, raw)
        m = re.fullmatch(rf"/(?:download/)?{V}/files/([^/:]+)(:download)?", path)
        if m:
            name = f"files/{m.group(1)}"
            if m.group(2):
                return Response(self.files[name], media_type="application/octet-stream")
            return JSONResponse(self._file(name))
        m = re.fullmatch(rf"/{V}/projects/([^/]+)/locations/([^/]+)/(.*)", path)
        if m:
            return self._vertex(method, m.group(1), m.group(2), m.group(3), request, raw)
        return _error(404, "NOT_FOUND", f"the fake has no {method} {path}")

    # -- online ------------------------------------------------------------------------------
    def _generate(self, body: dict[str, Any], model: str) -> JSONResponse:
        now = time.monotonic()
        text = _text(body)
        with self.lock:
            self.online_calls += 1
            if now < self.refused_until.get(text, 0.0):
                self.counts["early"] += 1
            every = self.settings.rate_limit_every
            if every and self.online_calls % every == 0:
                self.counts["rate_limited"] += 1
                self.refused_until[text] = now + self.settings.retry_delay
                delay = f"{self.settings.retry_delay:g}s"
                return _error(
                    429,
                    "RESOURCE_EXHAUSTED",
                    "You exceeded your current quota, please retry later.",
                    details=[
                        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}
                    ],
                )
            self.counts["ok"] += 1
            self._pay(body)
        return JSONResponse(_response(body, model))

    # -- the Gemini API's Batch Mode ---------------------------------------------------------
    def _gemini_create(self, body: dict[str, Any], model: str) -> JSONResponse:
        batch = body["batch"]
        source = batch["inputConfig"]
        if "requests" in source:
            lines = [
                {"key": (r.get("metadata") or {}).get("key"), "request": r["request"]}
                for r in source["requests"]["requests"]
            ]
            inline = True
        else:
            data = self.files[source["fileName"]]
            lines = [json.loads(line) for line in data.splitlines() if line.strip()]
            inline = False
        with self.lock:
            name = f"batches/{uuid.uuid4().hex[:16]}"
            job = Job(name, batch.get("displayName", ""), f"models/{model}", time.time(), False)
            job.requests, job.inline = lines, inline
            job.number = self.counts["creates"] + 1
            self.jobs[name] = job
            self.counts["creates"] += 1
            self.counts["submitted"] += len(lines)
        return JSONResponse(self._operation(job))

    def _state(self, job: Job) -> str:
        """The job's state now; it ends (and its requests are answered) once its time is up."""
        if job.state:
            return job.state
        age = time.time() - job.created
        if age < self.settings.pending_seconds:
            return "PENDING"
        if age < self.settings.pending_seconds + self.settings.running_seconds:
            return "RUNNING"
        self._end(job, "EXPIRED" if job.number <= self.settings.expire_jobs else "SUCCEEDED")
        return job.state

    def _end(self, job: Job, state: str) -> None:
        """Answer the job's requests (all, or the first half when it did not succeed)."""
        with self.ending:
            if not job.state:
                self._answer(job, state)

    def _answer(self, job: Job, state: str) -> None:
        with self.lock:
            ran = job.requests if state == "SUCCEEDED" else job.requests[: len(job.requests) // 2]
            answered = []
            for line in ran:
                request = line["request"]
                if self._fails(request):
                    error = {"code": 503, "message": "overloaded", "status": "UNAVAILABLE"}
                    answered.append((line, None, error))
                    self.counts["errors"] += 1
                else:
                    self._pay(request)
                    answered.append((line, _response(request, job.model), None))
            job.stats = {
                "succeeded": sum(1 for _, r, _ in answered if r is not None),
                "failed": sum(1 for _, r, _ in answered if r is None),
                "incomplete": len(job.requests) - len(answered),
            }
            self.counts[f"jobs_{state.lower()}"] += 1
            self.counts["unrun"] += len(job.requests) - len(answered)
        if job.vertex:
            self._write_predictions(job, answered)
        elif job.inline:
            job.output = {
                "inlinedResponses": {
                    "inlinedResponses": [
                        {"metadata": {"key": line["key"]}, "response": response}
                        if response is not None
                        else {"metadata": {"key": line["key"]}, "error": error}
                        for line, response, error in answered
                    ]
                }
            }
        else:
            name = f"files/batch-{uuid.uuid4().hex[:12]}"
            self.files[name] = b"".join(
                json.dumps(
                    {"key": line["key"], "response": response}
                    if response is not None
                    else {"key": line["key"], "error": error}
                ).encode()
                + b"\n"
                for line, response, error in answered
            )
            job.output = {"responsesFile": name}
        job.state = state

    def _operation(self, job: Job) -> dict[str, Any]:
        state = self._state(job)
        metadata: dict[str, Any] = {
            "@type": "type.googleapis.com/google.ai.generativelanguage.v1beta.GenerateContentBatch",
            "model": job.model,
            "displayName": job.display_name,
            "createTime": _iso(job.created),
            "updateTime": _iso(time.time()),
            "state": f"BATCH_STATE_{state}",
            "batchStats": {"requestCount": str(len(job.requests))},
        }
        if job.output:
            metadata["output"] = job.output
        return {"name": job.name, "metadata": metadata, "done": bool(job.state)}

    def _cancel(self, name: str) -> JSONResponse:
        job = self.jobs[name]
        self.counts["cancels"] += 1
        if self._state(job) in ("PENDING", "RUNNING"):
            self._end(job, "CANCELLED")
        return JSONResponse({})

    def _list(self, request: Request, vertex: bool, parent: str = "") -> JSONResponse:
        size = int(request.query_params.get("pageSize") or 50)
        start = int(request.query_params.get("pageToken") or 0)
        wanted = re.fullmatch(r'display_name="([^"]*)"', request.query_params.get("filter", ""))
        jobs = [j for j in self.jobs.values() if j.vertex == vertex and j.name.startswith(parent)]
        if wanted:
            jobs = [j for j in jobs if j.display_name == wanted.group(1)]
        jobs.sort(key=lambda j: j.created, reverse=True)  # newest first
        page = jobs[start : start + size]
        key = "batchPredictionJobs" if vertex else "operations"
        shown = [self._vertex_job(j) if vertex else self._operation(j) for j in page]
        body: dict[str, Any] = {key: shown}
        if start + size < len(jobs):
            body["nextPageToken"] = str(start + size)
        return JSONResponse(body)

    # -- the Files API -----------------------------------------------------------------------
    def _upload(self, request: Request, raw: bytes) -> Response:
        command = request.headers.get("x-goog-upload-command", "")
        if command == "start":
            upload_id = uuid.uuid4().hex
            self.uploads[upload_id] = {**json.loads(raw).get("file", {}), "data": b""}
            url = f"{self.base}{request.url.path}?upload_id={upload_id}"
            return Response(headers={"x-goog-upload-url": url, "x-goog-upload-status": "active"})
        upload = self.uploads[request.query_params["upload_id"]]
        upload["data"] += raw
        if "finalize" not in command:
            return Response(headers={"x-goog-upload-status": "active"})
        name = f"files/{uuid.uuid4().hex[:12]}"
        self.files[name] = upload.pop("data")
        self.counts["uploads"] += 1
        file = {**self._file(name), "displayName": upload.get("displayName", "")}
        return JSONResponse({"file": file}, headers={"x-goog-upload-status": "final"})

    def _file(self, name: str) -> dict[str, Any]:
        return {
            "name": name,
            "mimeType": "application/jsonl",
            "sizeBytes": str(len(self.files[name])),
            "state": "ACTIVE",
            "uri": f"{self.base}/v1/{name}",
        }

    # -- Vertex AI -----------------------------------------------------------------------------
    def _vertex(
        self, method: str, project: str, location: str, rest: str, request: Request, raw: bytes
    ) -> Response:
        parent = f"projects/{project}/locations/{location}"
        m = re.fullmatch(r"publishers/google/models/([^/:]+):generateContent", rest)
        if m and method == "POST":
            return self._generate(json.loads(raw), m.group(1))
        if rest == "batchPredictionJobs":
            if method == "POST":
                return self._vertex_create(json.loads(raw), parent)
            return self._list(request, vertex=True, parent=parent)
        m = re.fullmatch(r"batchPredictionJobs/([^/:]+)(:cancel)?", rest)
        if m:
            name = f"{parent}/batchPredictionJobs/{m.group(1)}"
            if m.group(2):
                return self._cancel(name)
            return JSONResponse(self._vertex_job(self.jobs[name]))
        return _error(404, "NOT_FOUND", f"the fake has no {method} {parent}/{rest}")

    def _fs(self) -> Any:
        from gcsfs.core import GCSFileSystem

        return GCSFileSystem(**self.settings.storage_options, skip_instance_cache=True)

    def _vertex_create(self, body: dict[str, Any], parent: str) -> JSONResponse:
        source = body["inputConfig"]
        if "gcsSource" not in source or "gcsDestination" not in body.get("outputConfig", {}):
            return _error(400, "INVALID_ARGUMENT", "the fake takes Cloud Storage jobs only")
        lines = []
        fs = self._fs()
        for uri in source["gcsSource"]["uris"]:
            with fs.open(uri, "rb") as f:
                lines += [json.loads(line) for line in f if line.strip()]
        with self.lock:
            name = f"{parent}/batchPredictionJobs/{next(self.numbers)}"
            job = Job(name, body.get("displayName", ""), body["model"], time.time(), True)
            job.requests = lines
            job.output_prefix = body["outputConfig"]["gcsDestination"]["outputUriPrefix"]
            job.number = self.counts["creates"] + 1
            self.jobs[name] = job
            self.counts["creates"] += 1
            self.counts["submitted"] += len(lines)
        return JSONResponse(self._vertex_job(job))

    def _write_predictions(self, job: Job, answered: list[Any]) -> None:
        stamp = datetime.fromtimestamp(job.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        directory = f"{job.output_prefix.rstrip('/')}/prediction-model-{stamp}"
        lines = []
        for line, response, error in answered:
            status = "" if error is None else f"{error['status']}: {error['message']}"
            out: dict[str, Any] = {"status": status, "request": line["request"]}
            if response is not None:
                out["response"] = response
            lines.append(json.dumps(out).encode() + b"\n")
        with self._fs().open(f"{directory}/predictions.jsonl", "wb") as f:
            f.write(b"".join(lines))
        job.output_directory = directory

    def _vertex_job(self, job: Job) -> dict[str, Any]:
        state = self._state(job)
        shown: dict[str, Any] = {
            "name": job.name,
            "displayName": job.display_name,
            "model": job.model,
            "state": f"JOB_STATE_{state}",
            "createTime": _iso(job.created),
            "updateTime": _iso(time.time()),
            "outputConfig": {
                "predictionsFormat": "jsonl",
                "gcsDestination": {"outputUriPrefix": job.output_prefix},
            },
        }
        if job.state:
            shown["endTime"] = _iso(time.time())
            shown["completionStats"] = {
                "successfulCount": str(job.stats["succeeded"]),
                "failedCount": str(job.stats["failed"]),
                "incompleteCount": str(job.stats["incomplete"]),
            }
            if job.output_directory:
                shown["outputInfo"] = {"gcsOutputDirectory": job.output_directory}
        return shown


@contextmanager
def serve(settings: Settings | None = None) -> Iterator[tuple[str, Fake]]:
    """Run the fake in a thread of this process; yield its base URL (no path) and itself."""
    fake = Fake(settings or Settings())
    with serving.in_thread(fake.app, "gemini fake") as url:
        fake.base = url.removesuffix("/v1")
        yield fake.base, fake


def service_account_file(path: str, base_url: str, project: str = "test-project") -> str:
    """Write a service account key file whose tokens come from the fake's ``/token``: what
    ``GOOGLE_APPLICATION_CREDENTIALS`` names for application default credentials. Its key is
    made here and signs nothing but the fake's token requests."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    info = {
        "type": "service_account",
        "project_id": project,
        "private_key_id": "fake",
        "private_key": pem,
        "client_email": f"batches@{project}.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": f"{base_url}/token",
    }
    with open(path, "w") as f:
        json.dump(info, f)
    return path
