"""Amazon Bedrock's batch inference as a ``BatchProvider`` (``engine/providers/submissions.py``).

It runs on ``boto3``: the ``bedrock`` client (the control plane of batch jobs), ``s3`` (their
input and output) and ``bedrock-runtime`` (the online calls of a submission too small for a
job). :class:`~checkpoint_assets.resources.bedrock.BedrockResource` makes it.

One submission is one JSONL file and one batch inference job ("model invocation job"):

- ``upload`` writes ``<input_prefix><tag>.jsonl`` to S3. Each line is ``{"recordId",
  "modelInput"}``: the record id is the request's index in the submission, 11 digits (Bedrock
  asks for an alphanumeric id), and the model input is the model's own InvokeModel body (for
  Claude, Anthropic's Messages body with ``anthropic_version``).
- ``create`` calls ``CreateModelInvocationJob`` with that file as input and
  ``<output_prefix><tag>/`` as output. The job's name is the tag, its ``clientRequestToken`` is
  the tag (Bedrock ignores a second create with the same token) and it is tagged with the tag
  (``TAG_KEY``).
- ``find``, after a crash, lists the jobs whose name holds the tag
  (``ListModelInvocationJobs``), submitted since the submission's intent.
- ``poll`` is ``GetModelInvocationJob``; ``cancel`` is ``StopModelInvocationJob``.
- ``results`` reads what Bedrock writes under ``<output_prefix><tag>/<job id>/``: one
  ``<tag>.jsonl.out`` whose lines hold the ``recordId`` and either a ``modelOutput`` (the
  InvokeModel response body) or an ``error`` (``errorCode``, ``errorMessage``), and
  ``manifest.json.out`` with the job's counts. A request is matched by its record id.

An error code of 408, 429 or 5xx is transient (``Result.retry``); any other (400 for an invalid
request) is not.

A submission below the minimum records of a job (``min_records``, 100 by Bedrock's quota) cannot
be a job: Bedrock refuses it. Such a submission is sent online instead, through
``bedrock-runtime`` InvokeModel, at the on-demand price. Waiting for more rows would not help: a
shard's rows are fixed, so a small shard, or the few rows of a retry, would never reach the
minimum. On fewer than 100 requests the online price costs at most the price of 50 more. Its id
is ``online:<tag>``; ``create`` sends nothing, the first ``poll`` sends the requests and writes
each answer to ``<output_prefix><tag>/online/<recordId>.json.out`` as it comes, and ``results``
reads them. After a kill, ``poll`` sends only the requests without an answer there, so a kill
pays again at most the requests in flight at that moment.

Queue room. Bedrock bounds the batch inference jobs submitted or in progress per model and
Region (the Service Quotas quota "Sum of in-progress and submitted batch inference jobs", often
10): ``concurrent_jobs``. A create past it is answered ``ServiceQuotaExceededException``, and
``create`` raises :class:`QueueFull` (kind ``concurrent_jobs``, with the number its message
states, if any): the submission waits for room, as the queue of ``engine/providers/queue.py``
shares it between shards.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from checkpoint_assets.engine.providers.submissions import (
    CONCURRENT_JOBS,
    TAG_KEY,
    Limits,
    Queue,
    QueueFull,
    Request,
    Result,
    State,
    Status,
    custom_id,
    index_of,
    queue_key,
)

__all__ = ["ONLINE", "BedrockBatches", "Quotas", "record_id"]

ONLINE: Final = "online:"  # the id prefix of a submission sent online (below min_records)
_STATES: Final = {
    "Submitted": State.RUNNING,
    "Validating": State.RUNNING,
    "Scheduled": State.RUNNING,
    "InProgress": State.RUNNING,
    "Stopping": State.RUNNING,
    "Completed": State.ENDED,
    "PartiallyCompleted": State.ENDED,  # the records that failed have an error line
    "Stopped": State.CANCELLED,
    "Expired": State.EXPIRED,
    "Failed": State.FAILED,
}
# A number of jobs in a quota refusal's message ("the quota of 10 in-progress ... jobs").
_STATED: Final = re.compile(r"(\d[\d,]*)\s+(?:in-progress|concurrent|submitted)", re.IGNORECASE)
_ONLINE_THREADS: Final = 8  # requests of an online submission in flight at once
_log = logging.getLogger("checkpoint_assets")


@dataclass(frozen=True)
class Quotas:
    """Bedrock's quotas of batch inference that shape submissions (Service Quotas, "Amazon
    Bedrock"; they differ by model and Region and may be raised, so the resource states them)."""

    min_records: int = 100  # Minimum number of records per batch inference job
    max_records_per_job: int = 50_000  # Records per batch inference job
    max_records_per_file: int = 50_000  # Records per input file per batch inference job
    max_file_bytes: int = 1_000_000_000  # Batch inference input file size
    max_job_bytes: int = 5_000_000_000  # Batch inference job size

    def limits(self) -> Limits:
        """One submission's limits: a submission is one file and one job."""
        records = min(self.max_records_per_job, self.max_records_per_file)
        return Limits(max_requests=records, max_bytes=min(self.max_file_bytes, self.max_job_bytes))


def record_id(index: int) -> str:
    """The ``recordId`` of the request at ``index`` of a submission: 11 digits, alphanumeric as
    Bedrock asks.

    >>> record_id(7)
    '00000000007'
    """
    return f"{index:011d}"


def _split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` as (bucket, key)."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


class BedrockBatches:
    """Bedrock's batch inference for one model (see the module docstring).

    ``bedrock``, ``runtime`` and ``s3`` are boto3 clients of one session; each request body is
    completed with ``defaults`` (the resource's ``anthropic_version`` and ``max_tokens``) where it
    leaves them out. ``input_prefix`` and ``output_prefix`` are ``s3://bucket/prefix/`` URIs.
    """

    name = "bedrock"

    def __init__(
        self,
        bedrock: Any,
        runtime: Any,
        s3: Any,
        *,
        model_id: str,
        role_arn: str,
        input_prefix: str,
        output_prefix: str,
        defaults: Mapping[str, Any] | None = None,
        quotas: Quotas = Quotas(),
        timeout_hours: int = 24,
        concurrent_jobs: int | None = None,
    ) -> None:
        self.bedrock, self.runtime, self.s3 = bedrock, runtime, s3
        self.model_id = model_id
        self.role_arn = role_arn
        self.input_prefix = input_prefix if input_prefix.endswith("/") else input_prefix + "/"
        self.output_prefix = output_prefix if output_prefix.endswith("/") else output_prefix + "/"
        self.defaults = dict(defaults or {})
        self.quotas = quotas
        self.limits = quotas.limits()
        self.timeout_hours = timeout_hours
        where = (bedrock.meta.region_name, bedrock.meta.endpoint_url)
        stated = {CONCURRENT_JOBS: concurrent_jobs} if concurrent_jobs else {}
        self.queue = Queue(queue_key(self.name, *where, model_id), stated)

    # -- the requests' file ----------------------------------------------------------------
    def _line(self, request: Request, tag: str) -> bytes:
        index = index_of(request.custom_id, tag)
        if index is None:
            raise ValueError(f"request {request.custom_id!r} is not of submission {tag}")
        record = {"recordId": record_id(index), "modelInput": {**self.defaults, **request.body}}
        return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

    def size(self, request: Request) -> int:
        tag = request.custom_id.rpartition("-")[0]
        return len(self._line(request, tag))

    def _input_uri(self, tag: str) -> str:
        return f"{self.input_prefix}{tag}.jsonl"

    def upload(self, requests: Sequence[Request], tag: str) -> str:
        uri = self._input_uri(tag)
        bucket, key = _split_uri(uri)
        body = b"".join(self._line(r, tag) for r in requests)
        self.s3.put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/jsonl")
        return uri

    def _records(self, upload: str) -> list[dict[str, Any]]:
        bucket, key = _split_uri(upload)
        body = self.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        return [json.loads(line) for line in body.splitlines() if line.strip()]

    # -- the job -----------------------------------------------------------------------------
    def create(self, requests: Sequence[Request], upload: str | None, tag: str) -> str:
        if upload is None:
            raise ValueError(f"submission {tag}: a Bedrock job reads its file: upload it first")
        count = len(requests) if requests else len(self._records(upload))
        if count < self.quotas.min_records:
            _log.info(
                "submission %s: %d request(s), below Bedrock's minimum of %d records per batch "
                "job: they are sent online (on-demand price) when the submission is polled.",
                tag,
                count,
                self.quotas.min_records,
            )
            return ONLINE + tag
        try:
            made = self.bedrock.create_model_invocation_job(
                jobName=tag,
                clientRequestToken=tag,
                roleArn=self.role_arn,
                modelId=self.model_id,
                inputDataConfig={"s3InputDataConfig": {"s3Uri": upload, "s3InputFormat": "JSONL"}},
                outputDataConfig={"s3OutputDataConfig": {"s3Uri": f"{self.output_prefix}{tag}/"}},
                timeoutDurationInHours=self.timeout_hours,
                tags=[{"key": TAG_KEY, "value": tag}],
            )
        except self.bedrock.exceptions.ServiceQuotaExceededException as e:
            raise _queue_full(e, tag) from e
        return str(made["jobArn"])

    def find(self, tag: str, since: float) -> str | None:
        after = datetime.fromtimestamp(since, UTC)
        pages = self.bedrock.get_paginator("list_model_invocation_jobs")
        for page in pages.paginate(nameContains=tag, submitTimeAfter=after):
            for job in page.get("invocationJobSummaries", []):
                if job.get("jobName") == tag:
                    return str(job["jobArn"])
        return None

    def poll(self, batch_id: str) -> Status:
        if batch_id.startswith(ONLINE):
            return self._online(batch_id.removeprefix(ONLINE))
        job = self.bedrock.get_model_invocation_job(jobIdentifier=batch_id)
        state = _STATES.get(job["status"])
        if state is None:
            raise ValueError(f"Bedrock job {batch_id} has an unknown status {job['status']!r}")
        return Status(
            state,
            succeeded=int(job.get("successRecordCount") or 0),
            failed=int(job.get("errorRecordCount") or 0),
            total=int(job.get("totalRecordCount") or 0),
            detail=str(job.get("message") or ""),
        )

    def cancel(self, batch_id: str) -> None:
        if batch_id.startswith(ONLINE):
            return  # its requests are sent within one poll: nothing waits to be stopped
        # A ConflictException: the job has ended or is stopping already.
        with contextlib.suppress(self.bedrock.exceptions.ConflictException):
            self.bedrock.stop_model_invocation_job(jobIdentifier=batch_id)

    # -- results -----------------------------------------------------------------------------
    def results(self, batch_id: str) -> Iterator[Result]:
        if batch_id.startswith(ONLINE):
            tag = batch_id.removeprefix(ONLINE)
            for key, body in self._objects(f"{self.output_prefix}{tag}/online/"):
                if key.endswith(".json.out"):
                    yield _result(json.loads(body), tag)
            return
        job = self.bedrock.get_model_invocation_job(jobIdentifier=batch_id)
        tag = str(job["jobName"])
        output = job["outputDataConfig"]["s3OutputDataConfig"]["s3Uri"]
        output = output if output.endswith("/") else output + "/"
        job_id = batch_id.rsplit("/", 1)[-1]
        for key, body in self._objects(f"{output}{job_id}/"):
            if key.endswith(".jsonl.out"):
                for line in body.splitlines():
                    if line.strip():
                        yield _result(json.loads(line), tag)

    def _objects(self, prefix: str) -> Iterator[tuple[str, bytes]]:
        """The keys and bodies of the objects under the ``s3://`` ``prefix``."""
        bucket, key_prefix = _split_uri(prefix)
        for page in self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=key_prefix
        ):
            for item in page.get("Contents", []):
                body = self.s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
                yield item["Key"], body

    # -- a submission below the minimum, sent online ----------------------------------------
    def _online(self, tag: str) -> Status:
        """Send the requests of ``tag`` that have no answer yet, writing each answer to S3 as it
        comes; the submission has then ended."""
        records = self._records(self._input_uri(tag))
        prefix = f"{self.output_prefix}{tag}/online/"
        bucket, key_prefix = _split_uri(prefix)
        answered = set()
        for page in self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=key_prefix
        ):
            answered |= {item["Key"].rsplit("/", 1)[-1] for item in page.get("Contents", [])}
        todo = [r for r in records if f"{r['recordId']}.json.out" not in answered]

        def send(record: dict[str, Any]) -> dict[str, Any]:
            line = {"recordId": record["recordId"], **self._invoke(record["modelInput"])}
            key = f"{key_prefix}{record['recordId']}.json.out"
            self.s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(line).encode())
            return line

        with ThreadPoolExecutor(_ONLINE_THREADS) as pool:
            lines = list(pool.map(send, todo))
        failed = sum("error" in line for line in lines)
        done = len(records) - len(todo)  # answered by an earlier run: counted as succeeded
        return Status(
            State.ENDED, succeeded=done + len(lines) - failed, failed=failed, total=len(records)
        )

    def _invoke(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """One InvokeModel call: ``{"modelOutput": ...}``, or ``{"error": ...}`` in the job
        output's form when Bedrock answers with an error status."""
        try:
            answer = self.runtime.invoke_model(
                modelId=self.model_id,
                body=json.dumps(body).encode(),
                contentType="application/json",
                accept="application/json",
            )
        except self.runtime.exceptions.ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            message = e.response.get("Error", {}).get("Message", str(e))
            return {"error": {"errorCode": status, "errorMessage": message}}
        return {"modelOutput": json.loads(answer["body"].read())}


def _queue_full(error: Any, tag: str) -> QueueFull:
    """A ``ServiceQuotaExceededException`` on create: no room for one more job of the model,
    with the number of jobs its message states, if any."""
    message = str(error.response.get("Error", {}).get("Message") or error)
    stated = _STATED.search(message)
    limit = {CONCURRENT_JOBS: int(stated[1].replace(",", ""))} if stated else {}
    return QueueFull(
        f"submission {tag}: ServiceQuotaExceededException: {message}",
        kind=CONCURRENT_JOBS,
        stated=limit,
    )


def _result(line: Mapping[str, Any], tag: str) -> Result:
    """One output line as a ``Result`` of the submission ``tag``."""
    record = str(line.get("recordId", ""))
    custom = custom_id(tag, int(record)) if record.isdigit() else f"{tag}-?{record}"
    output = line.get("modelOutput")
    if isinstance(output, dict):
        return Result(custom, output)
    error = line.get("error") or {}
    code = error.get("errorCode")
    status = int(str(code)) if str(code).isdigit() else 0
    transient = status in (408, 429) or status >= 500
    return Result(custom, None, f"Bedrock error {code}: {error.get('errorMessage')}", transient)
