"""A fake of Amazon Bedrock's control plane (batch inference jobs) and runtime (InvokeModel,
Converse), written from AWS's API reference, on a real HTTP server on 127.0.0.1 that boto3
reaches through ``endpoint_url``. Job input is read from, and output written to, S3 on moto's
server.

What it serves (REST-JSON, as botocore's ``bedrock`` and ``bedrock-runtime`` models send it):

- ``POST /model-invocation-job``: CreateModelInvocationJob. Idempotent by
  ``clientRequestToken``; ``ServiceQuotaExceededException`` (400) when ``max_jobs`` jobs are
  submitted or in progress; a job of fewer than ``min_records`` records ends ``Failed``, as
  Bedrock's validation says.
- ``GET /model-invocation-job/{id}``, ``POST /model-invocation-job/{id}/stop``,
  ``GET /model-invocation-jobs`` (``nameContains``, ``submitTimeAfter``, ``maxResults``,
  ``nextToken``).
- ``POST /model/{modelId}/invoke`` and ``/converse``: one answer, at once.
- ``GET /_fake/stats``: what it processed, for the tests.

A job is worked on by a thread: ``Submitted``, then ``InProgress`` after ``start_delay``, then
``records_per_second`` records at a time, each counted by its row (the text of its first
message). When every record ran, or it was stopped, it writes ``<output>/<job id>/<file>.out``
(one line per record run: ``recordId``, ``modelInput``, ``modelOutput`` or ``error``) and
``manifest.json.out``, then ends ``Completed`` (``PartiallyCompleted`` with errors) or
``Stopped``.

Answers are Claude's Messages bodies: ``content[0].text`` is ``"answer: <text>"``, with usage.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import boto3

ACCOUNT = "123456789012"
ACTIVE = ("Submitted", "Validating", "Scheduled", "InProgress", "Stopping")


@dataclass
class Settings:
    start_delay: float = 0.0  # seconds Submitted before InProgress
    records_per_second: float = 1e9  # records run per second of InProgress
    min_records: int = 100
    max_jobs: int = 20  # submitted or in progress at once
    error_every: int = 0  # every n-th record (by recordId) fails with a 500 once; 0: none


@dataclass
class Job:
    arn: str
    name: str
    token: str | None
    model: str
    role: str
    input_uri: str
    output_uri: str
    submitted: datetime
    tags: list[dict[str, str]]
    status: str = "Submitted"
    message: str = ""
    records: list[dict[str, Any]] = field(default_factory=list)
    lines: list[dict[str, Any]] = field(default_factory=list)  # output lines, as they run
    stop: bool = False
    ended: datetime | None = None
    started: float = 0.0  # time.monotonic() when it went InProgress

    def describe(self) -> dict[str, Any]:
        failed = sum("error" in line for line in self.lines)
        return {
            "jobArn": self.arn,
            "jobName": self.name,
            "modelId": self.model,
            "roleArn": self.role,
            "clientRequestToken": self.token,
            "status": self.status,
            "message": self.message,
            "submitTime": self.submitted.isoformat(),
            "lastModifiedTime": datetime.now(UTC).isoformat(),
            **({"endTime": self.ended.isoformat()} if self.ended else {}),
            "inputDataConfig": {
                "s3InputDataConfig": {"s3Uri": self.input_uri, "s3InputFormat": "JSONL"}
            },
            "outputDataConfig": {"s3OutputDataConfig": {"s3Uri": self.output_uri}},
            "timeoutDurationInHours": 24,
            "totalRecordCount": len(self.records),
            "processedRecordCount": len(self.lines),
            "successRecordCount": len(self.lines) - failed,
            "errorRecordCount": failed,
        }


def row_of(body: dict[str, Any]) -> str:
    """The row a request is for: the text of its first message."""
    content = body["messages"][0]["content"]
    return content if isinstance(content, str) else str(content[0].get("text"))


def answer(body: dict[str, Any], model: str) -> dict[str, Any]:
    text = row_of(body)
    return {
        "id": "msg_" + secrets.token_hex(8),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": f"answer: {text}"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": max(1, len(text) // 4), "output_tokens": 3},
    }


class FakeBedrock:
    def __init__(self, s3_endpoint: str, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.s3 = boto3.client(
            "s3",
            endpoint_url=s3_endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        self.jobs: dict[str, Job] = {}  # by job id
        self.lock = threading.Lock()
        self.batch = Counter[str]()  # records run in jobs (successes and errors), by row
        self.batch_billed = Counter[str]()  # records answered in jobs, by row
        self.online = Counter[str]()  # InvokeModel / Converse answered, by row
        self.calls = Counter[str]()  # API calls, by operation
        self.failed_once: set[tuple[str, str]] = set()
        self._stopping = threading.Event()
        self._worker = threading.Thread(target=self._work, daemon=True)
        handler = type("Handler", (_Handler,), {"fake": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        host, port = self.server.server_address[:2]
        self.url = f"http://{host!s}:{port}"

    def start(self) -> FakeBedrock:
        self._thread.start()
        self._worker.start()
        return self

    def close(self) -> None:
        self._stopping.set()
        self.server.shutdown()
        self.server.server_close()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            paid = self.batch_billed + self.online
            return {
                "jobs": len(self.jobs),
                "creates": self.calls["create"],
                "batch_records": sum(self.batch.values()),
                "online_requests": sum(self.online.values()),
                "paid": sum(paid.values()),
                "rows_paid": len(paid),
                "paid_twice": sum(1 for n in paid.values() if n > 1),
                "submitted_twice": sum(1 for n in (self.batch + self.online).values() if n > 1),
            }

    # -- the control plane ----------------------------------------------------------------
    def create(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], str | None]:
        self.calls["create"] += 1
        for need in ("jobName", "roleArn", "modelId", "inputDataConfig", "outputDataConfig"):
            if need not in body:
                return 400, {"message": f"{need} is required"}, "ValidationException"
        with self.lock:
            token = body.get("clientRequestToken")
            for job in self.jobs.values():
                if token is not None and job.token == token:
                    return 200, {"jobArn": job.arn}, None
            active = sum(j.status in ACTIVE for j in self.jobs.values())
            if active >= self.settings.max_jobs:
                message = (
                    f"You have reached the quota of {self.settings.max_jobs} in-progress and "
                    "submitted batch inference jobs for this model."
                )
                return 400, {"message": message}, "ServiceQuotaExceededException"
            job_id = secrets.token_hex(6)
            job = Job(
                arn=f"arn:aws:bedrock:us-east-1:{ACCOUNT}:model-invocation-job/{job_id}",
                name=body["jobName"],
                token=token,
                model=body["modelId"],
                role=body["roleArn"],
                input_uri=body["inputDataConfig"]["s3InputDataConfig"]["s3Uri"],
                output_uri=body["outputDataConfig"]["s3OutputDataConfig"]["s3Uri"],
                submitted=datetime.now(UTC),
                tags=body.get("tags", []),
            )
            self.jobs[job_id] = job
        return 200, {"jobArn": job.arn}, None

    def job(self, identifier: str) -> Job | None:
        return self.jobs.get(unquote(identifier).rsplit("/", 1)[-1])

    def list_jobs(self, query: dict[str, list[str]]) -> dict[str, Any]:
        self.calls["list"] += 1
        name = query.get("nameContains", [""])[0]
        after = query.get("submitTimeAfter", [None])[0]
        since = datetime.fromisoformat(after.replace("Z", "+00:00")) if after else None
        limit = int(query.get("maxResults", ["50"])[0])
        start = int(query.get("nextToken", ["0"])[0])
        with self.lock:
            jobs = sorted(self.jobs.values(), key=lambda j: j.submitted, reverse=True)
            found = [
                j.describe()
                for j in jobs
                if name in j.name and (since is None or j.submitted >= since)
            ]
        page = found[start : start + limit]
        more = start + limit < len(found)
        return {"invocationJobSummaries": page} | (
            {"nextToken": str(start + limit)} if more else {}
        )

    # -- the jobs' worker ---------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stopping.is_set():
            with self.lock:
                jobs = [j for j in self.jobs.values() if j.status in ACTIVE]
            for job in jobs:
                try:
                    self._step(job)
                except Exception as e:  # a fake's bug shows as the job's failure
                    job.status, job.message = "Failed", f"fake: {type(e).__name__}: {e}"
            time.sleep(0.02)

    def _step(self, job: Job) -> None:
        s = self.settings
        if job.status == "Submitted":
            if (datetime.now(UTC) - job.submitted).total_seconds() < s.start_delay:
                return
            bucket, _, key = job.input_uri.removeprefix("s3://").partition("/")
            text = self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            job.records = [json.loads(line) for line in text.splitlines() if line.strip()]
            if len(job.records) < s.min_records:
                job.status = "Failed"
                job.message = (
                    f"The number of records ({len(job.records)}) is below the minimum number of "
                    f"records per batch inference job ({s.min_records})."
                )
                return
            job.status = "InProgress"
            job.started = time.monotonic()
            return
        if job.status in ("InProgress", "Stopping"):
            if not job.stop:
                elapsed = time.monotonic() - job.started
                due = min(len(job.records), int(elapsed * s.records_per_second) + 1)
                for record in job.records[len(job.lines) : due]:
                    job.lines.append(self._run(job, record))
                if len(job.lines) < len(job.records):
                    return
            self._write(job)
            failed = any("error" in line for line in job.lines)
            with self.lock:
                job.status = (
                    "Stopped" if job.stop else "PartiallyCompleted" if failed else "Completed"
                )
                job.ended = datetime.now(UTC)

    def _run(self, job: Job, record: dict[str, Any]) -> dict[str, Any]:
        body = record["modelInput"]
        row = row_of(body)
        line = {"recordId": record["recordId"], "modelInput": body}
        with self.lock:
            self.batch[row] += 1
            n = self.settings.error_every
            if n and int(record["recordId"]) % n == 0 and (job.name, row) not in self.failed_once:
                self.failed_once.add((job.name, row))
                return line | {"error": {"errorCode": 500, "errorMessage": "Internal error"}}
            self.batch_billed[row] += 1
        return line | {"modelOutput": answer(body, job.model)}

    def _write(self, job: Job) -> None:
        output = job.output_uri if job.output_uri.endswith("/") else job.output_uri + "/"
        bucket, _, prefix = output.removeprefix("s3://").partition("/")
        job_id = job.arn.rsplit("/", 1)[-1]
        file = job.input_uri.rsplit("/", 1)[-1]
        body = "".join(json.dumps(line) + "\n" for line in job.lines).encode()
        self.s3.put_object(Bucket=bucket, Key=f"{prefix}{job_id}/{file}.out", Body=body)
        failed = sum("error" in line for line in job.lines)
        manifest = {
            "totalRecordCount": len(job.records),
            "processedRecordCount": len(job.lines),
            "successRecordCount": len(job.lines) - failed,
            "errorRecordCount": failed,
            "inputTokenCount": 0,
            "outputTokenCount": 0,
        }
        key = f"{prefix}{job_id}/manifest.json.out"
        self.s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())

    # -- the runtime ------------------------------------------------------------------------------
    def invoke(self, model: str, body: dict[str, Any], converse: bool) -> dict[str, Any]:
        if converse:
            text = body["messages"][0]["content"][0]["text"]
            with self.lock:
                self.online[text] += 1
            return {
                "output": {
                    "message": {"role": "assistant", "content": [{"text": f"answer: {text}"}]}
                },
                "stopReason": "end_turn",
                "usage": {"inputTokens": 1, "outputTokens": 3, "totalTokens": 4},
                "metrics": {"latencyMs": 1},
            }
        with self.lock:
            self.online[row_of(body)] += 1
        return answer(body, model)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeBedrock
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # an answer's headers and body go out at once

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: dict[str, Any], error: str | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if error is not None:
            self.send_header("x-amzn-ErrorType", error)
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def do_GET(self) -> None:
        url = urlparse(self.path)
        parts = url.path.strip("/").split("/")
        fake = self.fake
        if url.path == "/_fake/stats":
            return self._send(200, fake.stats())
        if url.path == "/model-invocation-jobs":
            return self._send(200, fake.list_jobs(parse_qs(url.query)))
        if parts[0] == "model-invocation-job" and len(parts) == 2:
            fake.calls["get"] += 1
            job = fake.job(parts[1])
            if job is None:
                return self._send(404, {"message": "no such job"}, "ResourceNotFoundException")
            with fake.lock:
                return self._send(200, job.describe())
        self._send(404, {"message": f"no route {url.path}"}, "ResourceNotFoundException")

    def do_POST(self) -> None:
        url = urlparse(self.path)
        parts = url.path.strip("/").split("/")
        fake = self.fake
        body = self._body()
        if url.path == "/model-invocation-job":
            status, answer_body, error = fake.create(body)
            return self._send(status, answer_body, error)
        if parts[0] == "model-invocation-job" and len(parts) == 3 and parts[2] == "stop":
            fake.calls["stop"] += 1
            job = fake.job(parts[1])
            if job is None:
                return self._send(404, {"message": "no such job"}, "ResourceNotFoundException")
            with fake.lock:
                if job.status not in ACTIVE:
                    return self._send(400, {"message": "job ended"}, "ConflictException")
                job.stop, job.status = True, "Stopping"
            return self._send(200, {})
        if parts[0] == "model" and len(parts) == 3 and parts[2] in ("invoke", "converse"):
            model = unquote(parts[1])
            return self._send(200, fake.invoke(model, body, converse=parts[2] == "converse"))
        self._send(404, {"message": f"no route {url.path}"}, "ResourceNotFoundException")


@contextmanager
def serve(s3_endpoint: str, settings: Settings | None = None) -> Iterator[FakeBedrock]:
    """The fake on a free port of 127.0.0.1, for the ``with`` block."""
    fake = FakeBedrock(s3_endpoint, settings).start()
    try:
        yield fake
    finally:
        fake.close()
