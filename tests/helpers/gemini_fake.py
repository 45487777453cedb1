"""A fake of Google's Gemini API and of Vertex AI's batch prediction, on 127.0.0.1, written from
Google's documentation and from the requests the ``google-genai`` client sends.

One server speaks both:

- the Gemini API (``/v1`` or ``/v1beta``): ``models/{m}:generateContent``, Batch Mode
  (``models/{m}:batchGenerateContent``; ``batches`` get, list, ``:cancel``) with inline requests
  (``metadata.key``) answered inline and JSONL files (``{"key", "request"}``) answered as a
  responses file; the Files API's resumable upload (``/upload/v1/files``), get and download
  (``files/{id}:download?alt=media``);
- Vertex AI (``/v1`` or ``/v1beta1``, ``projects/{p}/locations/{l}``):
  ``publishers/google/models/{m}:generateContent`` and ``batchPredictionJobs`` (create, get, list
  with a ``display_name`` filter, ``:cancel``), reading the JSONL input from Cloud Storage and
  writing ``predictions.jsonl`` under the output prefix (on fake-gcs-server, through gcsfs),
  each line the request as sent, its ``response`` and ``status`` (the error's words);
- ``/token``: an OAuth token endpoint, so that a service account's key file (application
  default credentials) gets its access token here.

A job moves as the local batch provider's batches do (``examples/llm_batch/jobs.py``, by its
``Settings`` and its clock): PENDING while validating, RUNNING while its requests end one after
another, then SUCCEEDED; EXPIRED with the first half answered when ``expires`` draws it (by
``api``, ``gemini`` or ``vertex``, and the job's number); CANCELLED keeping what was answered
before the cancel. A request is answered as a chat request of its text would be there (the
ticket's department; a 500 for a share ``error_rate``, here ``INTERNAL``; a request with no
text is ``INVALID_ARGUMENT``), in Gemini's shape. Its results come in an order of their own.

Online, every ``rate_limit_every``-th ``generateContent`` is refused with 429
``RESOURCE_EXHAUSTED`` and a ``retryDelay`` of ``retry_delay`` seconds; a refused request sent
again before its delay has passed counts in ``early``.

``snapshot()`` (and ``GET /stats``) holds the ledger's counts (``processed``, ``succeeded``,
``errored``, ``expired``, ``cancelled``, tokens), ``creates``, ``cancels``, ``submitted``,
``uploads``, the online ``ok``, ``rate_limited`` and ``early``, and ``paid_twice``: the texts
answered more than once (a row's text is its own, so a row paid twice shows).
"""

from __future__ import annotations

import atexit
import json
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from examples import serving
from examples.llm_batch.common import Ledger
from examples.llm_batch.jobs import CHAT, Answerer, Job, Outcome, Phase, Settings, expires

# The API versions a client may name: the Gemini API's v1 and v1beta, Vertex AI's v1 and v1beta1.
V = "(?:v1|v1beta|v1beta1)"
_STATES = {
    Phase.VALIDATING: "PENDING",
    Phase.IN_PROGRESS: "RUNNING",
    Phase.FINALIZING: "RUNNING",
    Phase.CANCELLING: "CANCELLING",
    Phase.COMPLETED: "SUCCEEDED",
    Phase.EXPIRED: "EXPIRED",
    Phase.CANCELLED: "CANCELLED",
    Phase.FAILED: "FAILED",
}
_RPC = {400: "INVALID_ARGUMENT", 500: "INTERNAL"}
_ZEROS = dict.fromkeys(
    ("creates", "cancels", "submitted", "processed", "succeeded", "errored", "expired"), 0
) | dict.fromkeys(("cancelled", "input_tokens", "output_tokens", "uploads", "ok"), 0)


@dataclass
class Batch:
    """One job of either API: the ledger's ``Job`` and what the API shows of it."""

    job: Job
    name: str
    display_name: str
    model: str
    vertex: bool
    lines: list[dict[str, Any]]  # the input lines as sent: {"key", "request"} or {"request"}
    inline: bool = False
    output_prefix: str = ""
    output: dict[str, Any] = field(default_factory=dict)  # Gemini: inline responses or a file
    output_directory: str = ""  # Vertex: where predictions.jsonl was written


def text_of(request: dict[str, Any]) -> str:
    return " ".join(
        str(part.get("text", ""))
        for content in request.get("contents") or []
        for part in content.get("parts") or []
    ).strip()


def _chat(request: dict[str, Any], model: str) -> dict[str, Any]:
    """The chat request the ledger answers for a Gemini request (none of its text: invalid)."""
    text = text_of(request)
    return {"model": model, "messages": [{"role": "user", "content": text}] if text else []}


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


def _gemini(outcome: Outcome, model: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """An outcome as Gemini's (response, error)."""
    if outcome.status != 200 or outcome.body is None:
        kind, message = outcome.error or ("error", "failed")
        status = _RPC.get(outcome.status, "UNKNOWN")
        return None, {"code": outcome.status, "message": f"{kind}: {message}", "status": status}
    answer = outcome.body["choices"][0]["message"]["content"]
    prompt, output = outcome.tokens
    response = {
        "candidates": [
            {
                "content": {"role": "model", "parts": [{"text": answer}]},
                "finishReason": "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {
            "promptTokenCount": prompt,
            "candidatesTokenCount": output,
            "totalTokenCount": prompt + output,
        },
        "modelVersion": model,
    }
    return response, None


def _error(code: int, status: str, message: str, **extra: Any) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "status": status, **extra}}
    return JSONResponse(body, status_code=code)


class Fake:
    """The fake's state and its ASGI app (``app``)."""

    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], float] = time.time,
        *,
        storage_options: dict[str, Any] | None = None,
        rate_limit_every: int = 0,
        retry_delay: float = 0.5,
    ) -> None:
        self.settings, self.clock = settings, clock
        self.storage_options = storage_options or {}
        self.rate_limit_every, self.retry_delay = rate_limit_every, retry_delay
        self.lock = threading.Lock()
        self.ledger = Ledger(settings, clock)
        self.online_answers = Answerer(Settings(), Counter())  # online requests do not fail
        self.batches: dict[str, Batch] = {}
        self.numbers: Counter[str] = Counter()  # jobs created, by API
        self.files: dict[str, bytes] = {}
        self.uploads: dict[str, dict[str, Any]] = {}
        self.counts: Counter[str] = Counter()
        self.refused_until: dict[str, float] = {}  # a refused request's text: its retry time
        self.online_calls = 0
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
            self._settle_all()
            texts = Counter(
                text_of(line["request"])
                for b in self.batches.values()
                for line in b.lines[: len(b.job.outcomes)]
            )
            twice = sum(1 for n in texts.values() if n > 1)
            return {**_ZEROS, **self.ledger.counts, **self.counts, "paid_twice": twice}

    def processed(self) -> Counter[str]:
        """The requests processed in batches, per ``custom_id``."""
        with self.lock:
            self._settle_all()
            return Counter(o.custom_id for b in self.batches.values() for o in b.job.outcomes)

    def online(self) -> int:
        with self.lock:
            return self.counts["ok"]

    def _settle_all(self) -> None:
        now = self.clock()
        for batch in self.batches.values():
            self.ledger.settle(batch.job, now)

    async def token(self, request: Request) -> JSONResponse:
        self.counts["tokens"] += 1
        token = {"access_token": "fake-token", "expires_in": 3600, "token_type": "Bearer"}
        return JSONResponse(token)

    # -- routing -----------------------------------------------------------------------------
    async def dispatch(self, request: Request) -> Response:
        path = "/" + request.path_params["path"]
        raw = await request.body()
        try:
            with self.lock:
                return self._route(request.method, path, request, raw)
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
            name = f"batches/{m.group(1)}"
            if m.group(2):
                return self._cancel(name)
            return JSONResponse(self._operation(self.batches[name]))
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
            return self._vertex(
                method, f"projects/{m.group(1)}/locations/{m.group(2)}", m[3], request, raw
            )
        return _error(404, "NOT_FOUND", f"the fake has no {method} {path}")

    # -- online ------------------------------------------------------------------------------
    def _generate(self, body: dict[str, Any], model: str) -> JSONResponse:
        now = time.monotonic()
        text = text_of(body)
        self.online_calls += 1
        if now < self.refused_until.get(text, 0.0):
            self.counts["early"] += 1
        if self.rate_limit_every and self.online_calls % self.rate_limit_every == 0:
            self.counts["rate_limited"] += 1
            self.refused_until[text] = now + self.retry_delay
            retry = {"@type": "type.googleapis.com/google.rpc.RetryInfo"}
            retry["retryDelay"] = f"{self.retry_delay:g}s"
            message = "You exceeded your current quota, please retry later."
            return _error(429, "RESOURCE_EXHAUSTED", message, details=[retry])
        outcome = self.online_answers.answer(CHAT, "online", _chat(body, model))
        response, error = _gemini(outcome, model)
        if error is not None:
            return _error(error["code"], error["status"], error["message"])
        self.counts["ok"] += 1
        return JSONResponse(response)

    # -- both APIs' jobs ---------------------------------------------------------------------
    def _new(
        self,
        name: str,
        display: str,
        model: str,
        lines: list[dict[str, Any]],
        ids: list[str],
        vertex: bool,
    ) -> Batch:
        api = "vertex" if vertex else "gemini"
        self.numbers[api] += 1
        requests = [(i, _chat(line["request"], model)) for i, line in zip(ids, lines, strict=True)]
        job = Job(
            name,
            CHAT,
            requests,
            self.clock(),
            self.settings,
            expiring=expires(self.settings, api, self.numbers[api]),
        )
        batch = Batch(job, name, display, model, vertex, lines)
        job.on_end = lambda _, phase: self._ended(batch)
        self.batches[name] = batch
        self.counts["creates"] += 1
        self.counts["submitted"] += len(lines)
        return batch

    def _phase(self, batch: Batch) -> str:
        return _STATES[self.ledger.settle(batch.job, self.clock())]

    def _answered(self, batch: Batch) -> list[tuple[dict[str, Any], Any, Any]]:
        """The lines answered, each with its (response, error), in an order of their own."""
        pairs = [
            (line, *_gemini(outcome, batch.model))
            for line, outcome in zip(batch.lines, batch.job.outcomes, strict=False)
        ]
        order = self.ledger.shuffled(batch.job, [{"i": i} for i in range(len(pairs))])
        return [pairs[o["i"]] for o in order]

    def _ended(self, batch: Batch) -> None:
        answered = self._answered(batch)
        if batch.vertex:
            self._write_predictions(batch, answered)
            return
        keyed = [
            ({"response": r} if r is not None else {"error": e}) | {"key": line["key"]}
            for line, r, e in answered
        ]
        if batch.inline:
            inlined = [
                {k: v for k, v in item.items() if k != "key"} | {"metadata": {"key": item["key"]}}
                for item in keyed
            ]
            batch.output = {"inlinedResponses": {"inlinedResponses": inlined}}
        else:
            name = f"files/batch-{uuid.uuid4().hex[:12]}"
            self.files[name] = b"".join(json.dumps(item).encode() + b"\n" for item in keyed)
            batch.output = {"responsesFile": name}

    def _cancel(self, name: str) -> JSONResponse:
        batch = self.batches[name]
        self.counts["cancels"] += 1
        now = self.clock()
        self.ledger.settle(batch.job, now)
        if batch.job.phase(now) in (Phase.VALIDATING, Phase.IN_PROGRESS, Phase.FINALIZING):
            batch.job.cancelled_at = now
        return JSONResponse({})

    def _list(self, request: Request, vertex: bool, parent: str = "") -> JSONResponse:
        size = int(request.query_params.get("pageSize") or 50)
        start = int(request.query_params.get("pageToken") or 0)
        wanted = re.fullmatch(r'display_name="([^"]*)"', request.query_params.get("filter", ""))
        found = [
            b for b in self.batches.values() if b.vertex == vertex and b.name.startswith(parent)
        ]
        if wanted:
            found = [b for b in found if b.display_name == wanted.group(1)]
        found.sort(key=lambda b: b.job.created, reverse=True)  # newest first
        page = found[start : start + size]
        key = "batchPredictionJobs" if vertex else "operations"
        shown = [self._vertex_job(b) if vertex else self._operation(b) for b in page]
        body: dict[str, Any] = {key: shown}
        if start + size < len(found):
            body["nextPageToken"] = str(start + size)
        return JSONResponse(body)

    # -- the Gemini API's Batch Mode ---------------------------------------------------------
    def _queue_full(self, vertex: bool) -> JSONResponse | None:
        """The 429 of a create refused by ``Settings.refuse_creates``, as Google words it for
        each API (with a ``retryDelay`` of ``queue_retry_after``); None when it is not."""
        if not self.settings.refuses(self.counts):
            return None
        retry = {"@type": "type.googleapis.com/google.rpc.RetryInfo"}
        retry["retryDelay"] = f"{self.settings.queue_retry_after:g}s"
        message = (
            "Quota exceeded for aiplatform.googleapis.com/concurrent_batch_prediction_jobs: "
            "the project's limit of 8 concurrent batch prediction jobs."
            if vertex
            else "You have reached the limit of 100 concurrent batch jobs. Wait for some to "
            "end, then submit again."
        )
        return _error(429, "RESOURCE_EXHAUSTED", message, details=[retry])

    def _gemini_create(self, body: dict[str, Any], model: str) -> JSONResponse:
        refused = self._queue_full(vertex=False)
        if refused is not None:
            return refused
        batch = body["batch"]
        source = batch["inputConfig"]
        inline = "requests" in source
        if inline:
            lines = [
                {"key": (r.get("metadata") or {}).get("key"), "request": r["request"]}
                for r in source["requests"]["requests"]
            ]
        else:
            data = self.files[source["fileName"]]
            lines = [json.loads(line) for line in data.splitlines() if line.strip()]
        name = f"batches/{uuid.uuid4().hex[:16]}"
        ids = [str(line["key"]) for line in lines]
        created = self._new(
            name, batch.get("displayName", ""), f"models/{model}", lines, ids, False
        )
        created.inline = inline
        return JSONResponse(self._operation(created))

    def _operation(self, batch: Batch) -> dict[str, Any]:
        state = self._phase(batch)
        metadata: dict[str, Any] = {
            "@type": "type.googleapis.com/google.ai.generativelanguage.v1main.GenerateContentBatch",
            "model": batch.model,
            "displayName": batch.display_name,
            "createTime": _iso(batch.job.created),
            "updateTime": _iso(self.clock()),
            "state": f"BATCH_STATE_{state}",
            "batchStats": {"requestCount": str(len(batch.lines))},
        }
        if batch.output:
            metadata["output"] = batch.output
        return {"name": batch.name, "metadata": metadata, "done": bool(batch.output)}

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
        self, method: str, parent: str, rest: str, request: Request, raw: bytes
    ) -> Response:
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
            return JSONResponse(self._vertex_job(self.batches[name]))
        return _error(404, "NOT_FOUND", f"the fake has no {method} {parent}/{rest}")

    def _fs(self) -> Any:
        from gcsfs.core import GCSFileSystem

        return GCSFileSystem(**self.storage_options, skip_instance_cache=True)

    def _vertex_create(self, body: dict[str, Any], parent: str) -> JSONResponse:
        refused = self._queue_full(vertex=True)
        if refused is not None:
            return refused
        source = body["inputConfig"]
        if "gcsSource" not in source or "gcsDestination" not in body.get("outputConfig", {}):
            return _error(400, "INVALID_ARGUMENT", "the fake takes Cloud Storage jobs only")
        lines: list[dict[str, Any]] = []
        fs = self._fs()
        for uri in source["gcsSource"]["uris"]:
            with fs.open(uri, "rb") as f:
                lines += [json.loads(line) for line in f if line.strip()]
        ids = [
            str((line["request"].get("labels") or {}).get("checkpoint_assets_id")) for line in lines
        ]
        name = f"{parent}/batchPredictionJobs/{self.counts['creates'] + 1}"
        created = self._new(name, body.get("displayName", ""), body["model"], lines, ids, True)
        created.output_prefix = body["outputConfig"]["gcsDestination"]["outputUriPrefix"]
        return JSONResponse(self._vertex_job(created))

    def _write_predictions(self, batch: Batch, answered: list[Any]) -> None:
        stamp = datetime.fromtimestamp(batch.job.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        directory = f"{batch.output_prefix.rstrip('/')}/prediction-model-{stamp}"
        lines = []
        for line, response, error in answered:
            status = "" if error is None else f"{error['status']}: {error['message']}"
            out: dict[str, Any] = {"status": status, "request": line["request"]}
            if response is not None:
                out["response"] = response
            lines.append(json.dumps(out).encode() + b"\n")
        with self._fs().open(f"{directory}/predictions.jsonl", "wb") as f:
            f.write(b"".join(lines))
        batch.output_directory = directory

    def _vertex_job(self, batch: Batch) -> dict[str, Any]:
        state = self._phase(batch)
        shown: dict[str, Any] = {
            "name": batch.name,
            "displayName": batch.display_name,
            "model": batch.model,
            "state": f"JOB_STATE_{state}",
            "createTime": _iso(batch.job.created),
            "updateTime": _iso(self.clock()),
            "outputConfig": {
                "predictionsFormat": "jsonl",
                "gcsDestination": {"outputUriPrefix": batch.output_prefix},
            },
        }
        if batch.job.settled:
            outcomes = batch.job.outcomes
            ok = sum(1 for o in outcomes if o.status == 200)
            shown["endTime"] = _iso(batch.job.ended_at())
            shown["completionStats"] = {
                "successfulCount": str(ok),
                "failedCount": str(len(outcomes) - ok),
                "incompleteCount": str(len(batch.lines) - len(outcomes)),
            }
            if batch.output_directory:
                shown["outputInfo"] = {"gcsOutputDirectory": batch.output_directory}
        return shown


@contextmanager
def serve(
    settings: Settings | None = None, clock: Callable[[], float] = time.time, **options: Any
) -> Iterator[tuple[str, Fake]]:
    """Run the fake in a thread of this process; yield its base URL (no path) and itself.
    ``options``: :class:`Fake`'s (``storage_options``, ``rate_limit_every``, ``retry_delay``)."""
    fake = Fake(settings or Settings(), clock, **options)
    with serving.in_thread(fake.app, "gemini fake") as url:
        fake.base = url.removesuffix("/v1")
        yield fake.base, fake


_GCS: list[Any] = []


def gcs() -> Any:
    """This process's fake-gcs-server (``helpers.clouds.GcsEmulator``), started on first use
    and stopped when the process ends."""
    if not _GCS:
        from helpers.clouds import GcsEmulator

        _GCS.append(GcsEmulator())
        atexit.register(_GCS[0].stop)
    return _GCS[0]


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
