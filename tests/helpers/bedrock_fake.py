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

A job moves as the local batch provider's batches do (``examples/llm_batch/jobs.py``: its
``Settings`` and clock, ``processing_delay``, ``error_rate``, ``expire_rate``...; drawn by the
API name ``bedrock``), so the contract suite drives every fake alike. Its state is worked out
from the clock whenever it is asked. Once it has ended, it writes ``<output>/<job id>/<file>.out``
(one line per record run, in no particular order: ``recordId``, ``modelInput``, ``modelOutput``
or ``error``) and ``manifest.json.out``. Answers are Claude's Messages bodies, by the local
provider's rule (``classify``). It counts what it ran: per ``custom_id`` (the job's name, the tag,
and the record's index) and per row (the text of the first message), in batch and online.
"""

from __future__ import annotations

import json
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import boto3

from examples.llm_batch import jobs
from examples.llm_batch.jobs import ENDED, Phase, Settings

ACCOUNT = "123456789012"
API = "bedrock"  # the name batches are drawn by (``jobs.expires``)
# What ``snapshot`` counts, 0 until it happens (``provider_cases.COUNTS``).
COUNTS = ("creates", "cancels", "submitted", "processed", "succeeded", "errored", "expired")
COUNTS += ("cancelled", "input_tokens", "output_tokens")
_STATUS = {
    Phase.VALIDATING: "Validating",
    Phase.IN_PROGRESS: "InProgress",
    Phase.FINALIZING: "InProgress",
    Phase.COMPLETED: "Completed",
    Phase.EXPIRED: "Expired",
    Phase.CANCELLING: "Stopping",
    Phase.CANCELLED: "Stopped",
    Phase.FAILED: "Failed",
}


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
    timing: jobs.Job  # its requests, and when each is done
    records: list[dict[str, Any]] = field(default_factory=list)
    written: bool = False
    counted: int = 0  # outcomes counted by row so far

    def status(self, now: float) -> str:
        phase = self.timing.phase(now)
        if phase is Phase.COMPLETED and any(o.status != 200 for o in self.timing.outcomes):
            return "PartiallyCompleted"
        return _STATUS[phase]

    def describe(self, now: float) -> dict[str, Any]:
        outcomes = self.timing.outcomes
        failed = sum(o.status != 200 for o in outcomes)
        problems = self.timing.problems
        return {
            "jobArn": self.arn,
            "jobName": self.name,
            "modelId": self.model,
            "roleArn": self.role,
            "clientRequestToken": self.token,
            "status": self.status(now),
            "message": problems[0]["message"] if problems else "",
            "submitTime": self.submitted.isoformat(),
            "inputDataConfig": {
                "s3InputDataConfig": {"s3Uri": self.input_uri, "s3InputFormat": "JSONL"}
            },
            "outputDataConfig": {"s3OutputDataConfig": {"s3Uri": self.output_uri}},
            "timeoutDurationInHours": 24,
            "totalRecordCount": len(self.records),
            "processedRecordCount": len(outcomes),
            "successRecordCount": len(outcomes) - failed,
            "errorRecordCount": failed,
        }


def row_of(body: dict[str, Any]) -> str:
    """The row a request is for: the text of its first message."""
    content = body["messages"][0]["content"]
    return content if isinstance(content, str) else str(content[0].get("text"))


class FakeBedrock:
    def __init__(
        self,
        s3_endpoint: str,
        settings: Settings | None = None,
        clock: Callable[[], float] = time.time,
        *,
        min_records: int = 100,
        max_jobs: int = 20,
    ) -> None:
        self.settings = settings or Settings()
        self.clock = clock
        self.min_records = min_records
        self.max_jobs = max_jobs
        self.s3 = boto3.client(
            "s3",
            endpoint_url=s3_endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        self.jobs: dict[str, Job] = {}  # by job id
        self.lock = threading.RLock()
        self.counts = Counter[str]()  # the contract's counts (``provider_cases.COUNTS``)
        self.answerer = jobs.Answerer(self.settings, self.counts)
        self.batch_rows = Counter[str]()  # records run in jobs, by row
        self.batch_paid = Counter[str]()  # records answered in jobs, by row
        self.online = Counter[str]()  # InvokeModel / Converse answered, by row
        self.calls = Counter[str]()  # API calls, by operation
        handler = type("Handler", (_Handler,), {"fake": self})
        self.server = _Server(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        host, port = self.server.server_address[:2]
        self.url = f"http://{host!s}:{port}"

    def start(self) -> FakeBedrock:
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- what it counted --------------------------------------------------------------------
    def settle_all(self) -> None:
        with self.lock:
            for job in self.jobs.values():
                self._settle(job)

    def snapshot(self) -> dict[str, int]:
        """The contract's counts (``provider_cases.COUNTS``), every job worked out to now."""
        self.settle_all()
        with self.lock:
            return {name: self.counts[name] for name in COUNTS} | dict(self.counts)

    def processed(self) -> Counter[str]:
        """Records run in jobs, per ``custom_id``."""
        self.settle_all()
        with self.lock:
            return Counter(o.custom_id for j in self.jobs.values() for o in j.timing.outcomes)

    def stats(self) -> dict[str, Any]:
        """Jobs, records run and paid, by row, in batch and online."""
        self.settle_all()
        with self.lock:
            paid = self.batch_paid + self.online
            return {
                "jobs": len(self.jobs),
                "creates": self.calls["create"],
                "batch_records": sum(self.batch_rows.values()),
                "online_requests": sum(self.online.values()),
                "paid": sum(paid.values()),
                "rows_paid": len(paid),
                "paid_twice": sum(1 for n in paid.values() if n > 1),
                "submitted_twice": sum(
                    1 for n in (self.batch_rows + self.online).values() if n > 1
                ),
            }

    # -- the control plane ----------------------------------------------------------------
    def create(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], str | None]:
        self.calls["create"] += 1
        for need in ("jobName", "roleArn", "modelId", "inputDataConfig", "outputDataConfig"):
            if need not in body:
                return 400, {"message": f"{need} is required"}, "ValidationException"
        now = self.clock()
        with self.lock:
            token = body.get("clientRequestToken")
            for job in self.jobs.values():
                if token is not None and job.token == token:
                    return 200, {"jobArn": job.arn}, None
            active = sum(j.timing.phase(now) not in ENDED for j in self.jobs.values())
            if active >= self.max_jobs or self.settings.refuses(self.counts):
                message = (
                    f"You have reached the quota of {self.max_jobs} in-progress and submitted "
                    "batch inference jobs for this model."
                )
                return 400, {"message": message}, "ServiceQuotaExceededException"
            uri = body["inputDataConfig"]["s3InputDataConfig"]["s3Uri"]
            bucket, _, key = uri.removeprefix("s3://").partition("/")
            text = self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
            name, model = body["jobName"], body["modelId"]
            requests = [
                (f"{name}-{int(r['recordId'])}", {"model": model, **r["modelInput"]})
                for r in records
            ]
            timing = jobs.Job(
                id=secrets.token_hex(6),
                endpoint=jobs.MESSAGES,
                requests=requests,
                created=now,
                settings=self.settings,
                expiring=jobs.expires(self.settings, API, len(self.jobs) + 1),
            )
            if len(records) < self.min_records:
                timing.problems.append(
                    {
                        "message": f"The number of records ({len(records)}) is below the "
                        f"minimum number of records per batch inference job ({self.min_records})."
                    }
                )
            job = Job(
                arn=f"arn:aws:bedrock:us-east-1:{ACCOUNT}:model-invocation-job/{timing.id}",
                name=name,
                token=token,
                model=model,
                role=body["roleArn"],
                input_uri=uri,
                output_uri=body["outputDataConfig"]["s3OutputDataConfig"]["s3Uri"],
                submitted=datetime.fromtimestamp(now, UTC),
                timing=timing,
                records=records,
            )
            self.jobs[timing.id] = job
            self.counts["creates"] += 1
            self.counts["submitted"] += len(records)
        return 200, {"jobArn": job.arn}, None

    def job(self, identifier: str) -> Job | None:
        with self.lock:
            job = self.jobs.get(unquote(identifier).rsplit("/", 1)[-1])
            if job is not None:
                self._settle(job)
            return job

    def stop(self, job: Job) -> bool:
        now = self.clock()
        with self.lock:
            if job.timing.phase(now) not in jobs.CANCELLABLE:
                return False
            job.timing.advance(now, self.answerer)
            self._count_new(job)
            job.timing.cancelled_at = now
            self.counts["cancels"] += 1
            self._settle(job)
        return True

    def list_jobs(self, query: dict[str, list[str]]) -> dict[str, Any]:
        self.calls["list"] += 1
        name = query.get("nameContains", [""])[0]
        after = query.get("submitTimeAfter", [None])[0]
        since = datetime.fromisoformat(after.replace("Z", "+00:00")) if after else None
        limit = int(query.get("maxResults", ["50"])[0])
        start = int(query.get("nextToken", ["0"])[0])
        now = self.clock()
        with self.lock:
            listed = sorted(self.jobs.values(), key=lambda j: j.submitted, reverse=True)
            found = [
                j.describe(now)
                for j in listed
                if name in j.name and (since is None or j.submitted >= since)
            ]
        page = found[start : start + limit]
        more = start + limit < len(found)
        return {"invocationJobSummaries": page} | (
            {"nextToken": str(start + limit)} if more else {}
        )

    # -- a job worked out to now ------------------------------------------------------------
    def _settle(self, job: Job) -> None:
        """Run the records due by now; once the job has ended, count what it left unrun and
        write its output (inside the lock)."""
        now = self.clock()
        job.timing.advance(now, self.answerer)
        self._count_new(job)
        phase = job.timing.phase(now)
        if phase not in ENDED or job.written:
            return
        unrun = len(job.records) - len(job.timing.outcomes)
        if phase is Phase.EXPIRED:
            self.counts["expired"] += unrun
        elif phase is Phase.CANCELLED:
            self.counts["cancelled"] += unrun
        if phase is not Phase.FAILED:
            self._write(job)
        job.written = True

    def _count_new(self, job: Job) -> None:
        for outcome in job.timing.outcomes[job.counted :]:
            index = int(outcome.custom_id.rpartition("-")[2])
            body = job.records[index]["modelInput"]
            try:
                row = row_of(body)
            except (KeyError, IndexError, TypeError):
                row = outcome.custom_id
            self.batch_rows[row] += 1
            if outcome.status == 200:
                self.batch_paid[row] += 1
        job.counted = len(job.timing.outcomes)

    def _write(self, job: Job) -> None:
        output = job.output_uri if job.output_uri.endswith("/") else job.output_uri + "/"
        bucket, _, prefix = output.removeprefix("s3://").partition("/")
        lines = []
        for outcome in job.timing.outcomes:
            index = int(outcome.custom_id.rpartition("-")[2])
            record = job.records[index]
            line = {"recordId": record["recordId"], "modelInput": record["modelInput"]}
            if outcome.status == 200:
                line["modelOutput"] = outcome.body
            else:
                message = outcome.error[1] if outcome.error else "error"
                line["error"] = {"errorCode": outcome.status, "errorMessage": message}
            lines.append(line)
        random.Random(job.name).shuffle(lines)  # Bedrock keeps no order
        file = job.input_uri.rsplit("/", 1)[-1]
        body = "".join(json.dumps(line) + "\n" for line in lines).encode()
        self.s3.put_object(Bucket=bucket, Key=f"{prefix}{job.timing.id}/{file}.out", Body=body)
        failed = sum("error" in line for line in lines)
        manifest = {
            "totalRecordCount": len(job.records),
            "processedRecordCount": len(lines),
            "successRecordCount": len(lines) - failed,
            "errorRecordCount": failed,
            "inputTokenCount": sum(o.tokens[0] for o in job.timing.outcomes),
            "outputTokenCount": sum(o.tokens[1] for o in job.timing.outcomes),
        }
        key = f"{prefix}{job.timing.id}/manifest.json.out"
        self.s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())

    # -- the runtime ------------------------------------------------------------------------------
    def invoke(
        self, model: str, body: dict[str, Any], converse: bool
    ) -> tuple[int, dict[str, Any]]:
        """One online answer (status, body): never a drawn error, as the local chat server."""
        params = dict(body)
        if converse:
            texts = [c.get("text") for m in body.get("messages", []) for c in m.get("content", [])]
            params = {
                "messages": [{"role": "user", "content": t} for t in texts if isinstance(t, str)],
                "max_tokens": (body.get("inferenceConfig") or {}).get("maxTokens", 1024),
            }
        try:
            outcome = jobs._message("online", {"model": model, **params})
        except (AttributeError, KeyError, TypeError, ValueError):
            return 400, {"message": "messages: a non-empty list of messages is required"}
        with self.lock:
            self.online[row_of(params)] += 1
        assert outcome.body is not None
        if not converse:
            return 200, outcome.body
        text = outcome.body["content"][0]["text"]
        usage = outcome.body["usage"]
        return 200, {
            "output": {"message": {"role": "assistant", "content": [{"text": text}]}},
            "stopReason": "end_turn",
            "usage": {
                "inputTokens": usage["input_tokens"],
                "outputTokens": usage["output_tokens"],
                "totalTokens": usage["input_tokens"] + usage["output_tokens"],
            },
            "metrics": {"latencyMs": 1},
        }


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client killed mid-request (the kill tests) resets its connection: not news


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
        if url.path == "/model-invocation-jobs":
            return self._send(200, fake.list_jobs(parse_qs(url.query)))
        if parts[0] == "model-invocation-job" and len(parts) == 2:
            fake.calls["get"] += 1
            job = fake.job(parts[1])
            if job is None:
                return self._send(404, {"message": "no such job"}, "ResourceNotFoundException")
            with fake.lock:
                return self._send(200, job.describe(fake.clock()))
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
            if not fake.stop(job):
                return self._send(400, {"message": "the job has ended"}, "ConflictException")
            return self._send(200, {})
        if parts[0] == "model" and len(parts) == 3 and parts[2] in ("invoke", "converse"):
            status, answer = fake.invoke(unquote(parts[1]), body, parts[2] == "converse")
            return self._send(status, answer, None if status == 200 else "ValidationException")
        self._send(404, {"message": f"no route {url.path}"}, "ResourceNotFoundException")


@contextmanager
def serve(
    s3_endpoint: str,
    settings: Settings | None = None,
    clock: Callable[[], float] = time.time,
    **kw: Any,
) -> Iterator[FakeBedrock]:
    """The fake on a free port of 127.0.0.1, for the ``with`` block (``kw``: ``min_records``,
    ``max_jobs``)."""
    fake = FakeBedrock(s3_endpoint, settings, clock, **kw).start()
    try:
        yield fake
    finally:
        fake.close()


@contextmanager
def moto_s3() -> Iterator[str]:
    """moto's S3 server on a free port of 127.0.0.1, for the ``with`` block; its URL."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    server = make_server("127.0.0.1", 0, app, True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()
