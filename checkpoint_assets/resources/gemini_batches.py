"""Gemini's batch APIs as ``BatchProvider`` s (``engine/providers/submissions.py``).

Both run on the ``google-genai`` client's ``batches`` module, one per backend:

- :class:`GeminiBatches`, the Gemini API's Batch Mode. A submission under ``inline_max_bytes``
  (Google's limit is 20 MB) goes inline in the create's body, each request with
  ``metadata.key``, and its responses come back inline. A larger one is uploaded first through
  the Files API as a JSONL file (``{"key", "request"}`` per line), and its responses come back
  as a file, downloaded to a temporary file and read line by line.
- :class:`VertexBatches`, Vertex AI batch prediction. A submission is a JSONL file written to
  Cloud Storage under ``gcs_prefix`` (``<tag>/input.jsonl``). Its predictions are written under
  ``<tag>/output/``. Vertex copies each request into its prediction line, so the request's
  ``labels`` carry its ``custom_id`` (label ``checkpoint_assets_id``). BigQuery tables are not
  taken: the rows come from the checkpointed asset, and a Cloud Storage prefix holds them.

Every request body is the REST ``GenerateContentRequest`` of Google's documentation
(``contents``, ``generationConfig``, ``systemInstruction``, ``safetySettings``, ``tools``...),
with ``defaults`` (the resource's ``generationConfig`` settings) added where it leaves them out.
Every result body is a ``GenerateContentResponse`` in the same camelCase JSON, whichever way it
came.

Finding a job again after a crash (``find``): the job's display name is the submission's tag.
The Gemini API's list is read page by page until a page holds only jobs created before the
submission was recorded; Vertex's list is filtered by the display name.

Job states: ``JOB_STATE_QUEUED``, ``PENDING``, ``RUNNING``, ``CANCELLING`` and ``PAUSED`` are
running; ``SUCCEEDED`` and ``PARTIALLY_SUCCEEDED`` ended; ``EXPIRED`` and ``CANCELLED`` give
back the rows without a result (their results so far are collected); ``FAILED`` with no
result is refused as a whole, and with some results (Vertex writes partial ones) ended.

A request's error is transient (``Result.retry``) when its code is a rate limit, an overload,
a server error or a deadline (HTTP 429, 500, 503, 504; ``RESOURCE_EXHAUSTED``,
``UNAVAILABLE``, ``INTERNAL``, ``DEADLINE_EXCEEDED``).
"""

from __future__ import annotations

import inspect
import io
import json
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from checkpoint_assets.engine.providers.submissions import (
    CONCURRENT_JOBS,
    ENQUEUED_TOKENS,
    Limits,
    Queue,
    QueueFull,
    Request,
    Result,
    State,
    Status,
    queue_key,
)

if TYPE_CHECKING:
    from google import genai
    from google.genai import types

__all__ = ["GEMINI_LIMITS", "INLINE_MAX_BYTES", "GeminiBatches", "Jobs"]

#: Google's limit of a Batch Mode create whose requests go inline; larger ones go as a file.
INLINE_MAX_BYTES: Final = 20 * 1000 * 1000
# The Gemini API's input file may hold 2 GB; it states no count of requests, so a submission
# holds at most 50,000, which keeps one download of its results a few hundred MB at most.
GEMINI_LIMITS: Final = Limits(max_requests=50_000, max_bytes=2 * 1000 * 1000 * 1000)
_CLIENT_RETRIES: Final = (408, 429, 500, 502, 503, 504)  # google-genai's default retried codes
_RETRY_INFO: Final = "type.googleapis.com/google.rpc.RetryInfo"
# A limit a 429's message states ("Limit: 100 concurrent batch jobs", "2,000,000 tokens").
_STATED: Final = re.compile(
    r"(\d[\d,]*)\s+(?:enqueued\s+|concurrent\s+)?(?:tokens|batch|jobs)", re.IGNORECASE
)
_RUNNING: Final = frozenset(
    {
        "JOB_STATE_UNSPECIFIED",
        "JOB_STATE_QUEUED",
        "JOB_STATE_PENDING",
        "JOB_STATE_RUNNING",
        "JOB_STATE_CANCELLING",
        "JOB_STATE_PAUSED",
        "JOB_STATE_UPDATING",
    }
)
_ENDED: Final = frozenset({"JOB_STATE_SUCCEEDED", "JOB_STATE_PARTIALLY_SUCCEEDED"})
_TRANSIENT_CODES: Final = frozenset({4, 8, 13, 14, 429, 500, 503, 504})  # rpc and HTTP codes
_TRANSIENT_WORDS: Final = (
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "INTERNAL",
    "DEADLINE_EXCEEDED",
    "429",
    "500",
    "503",
    "504",
)
# The request fields the SDK's GenerateContentConfig takes flat, beside generationConfig's own.
_CONFIG_FIELDS: Final = (
    "systemInstruction",
    "safetySettings",
    "tools",
    "toolConfig",
    "cachedContent",
    "labels",
)


def with_defaults(body: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` with ``defaults`` (the resource's ``request_defaults()``, snake_case as the SDK
    names them) added to its ``generationConfig`` (camelCase, as the API names them) where it
    leaves them out.

    >>> with_defaults({"contents": []}, {"max_output_tokens": 8})
    {'contents': [], 'generationConfig': {'maxOutputTokens': 8}}
    """
    if not defaults:
        return dict(body)
    camel = {_camel(k): v for k, v in defaults.items()}
    config = {**camel, **(body.get("generationConfig") or {})}
    return {**body, "generationConfig": config}


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(word.title() for word in rest)


def checked(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """``body``, once it is known to hold only fields of a ``GenerateContentRequest``."""
    unknown = set(body) - {"contents", "generationConfig", *_CONFIG_FIELDS}
    if unknown:
        raise ValueError(
            f"request() returned fields that a GenerateContentRequest does not have: "
            f"{sorted(unknown)}. Return contents, generationConfig, systemInstruction, "
            "safetySettings, tools, toolConfig, cachedContent or labels (the REST names); the "
            "resource names the model."
        )
    return body


def sdk_arguments(body: Mapping[str, Any]) -> dict[str, Any]:
    """A REST ``GenerateContentRequest`` as the SDK's ``contents`` and ``config`` arguments:
    ``generationConfig``'s fields and the other settings go flat into ``config``."""
    from google.genai import types

    checked(body)
    flat = {**(body.get("generationConfig") or {})}
    flat.update({k: body[k] for k in _CONFIG_FIELDS if k in body})
    config = types.GenerateContentConfig.model_validate(flat) if flat else None
    return {"contents": body.get("contents") or [], "config": config}


def response_body(response: types.GenerateContentResponse) -> dict[str, Any]:
    """A ``GenerateContentResponse`` as the API's JSON (camelCase, unset fields left out)."""
    body = response.model_dump(mode="json", by_alias=True, exclude_none=True)
    body.pop("sdkHttpResponse", None)
    body.pop("automaticFunctionCallingHistory", None)  # the SDK's own, not the API's
    return body


def error_result(custom: str, error: Any) -> Result:
    """A request's error (a ``google.rpc.Status`` dict or a message) as a ``Result``."""
    if isinstance(error, Mapping):
        code, status = error.get("code"), error.get("status") or ""
        message = f"{status or code}: {error.get('message')}"
        retry = code in _TRANSIENT_CODES or status in _TRANSIENT_WORDS
        return Result(custom, None, message, retry=retry)
    text = str(error)
    return Result(custom, None, text, retry=any(w in text for w in _TRANSIENT_WORDS))


def created_since(created: datetime | None, since: float) -> bool:
    return created is None or created.timestamp() >= since


def _status(job: types.BatchJob) -> Status:
    state = str(job.state.value if job.state is not None else "JOB_STATE_UNSPECIFIED")
    stats = job.completion_stats
    succeeded = int(stats.successful_count or 0) if stats else 0
    failed = int(stats.failed_count or 0) if stats else 0
    total = succeeded + failed + (int(stats.incomplete_count or 0) if stats else 0)
    detail = job.error.message or "" if job.error is not None else ""
    counts = {"succeeded": succeeded, "failed": failed, "total": total, "detail": detail}
    if state in _RUNNING:
        return Status(State.RUNNING, **counts)  # type: ignore[arg-type]
    if state in _ENDED:
        return Status(State.ENDED, **counts)  # type: ignore[arg-type]
    if state == "JOB_STATE_EXPIRED":
        return Status(State.EXPIRED, **counts)  # type: ignore[arg-type]
    if state == "JOB_STATE_CANCELLED":
        return Status(State.CANCELLED, **counts)  # type: ignore[arg-type]
    if state == "JOB_STATE_FAILED" and succeeded:
        return Status(State.ENDED, **counts)  # type: ignore[arg-type]  # partial results
    return Status(State.FAILED, **{**counts, "detail": detail or state})  # type: ignore[arg-type]


def _queue_full(error: Exception, model: str) -> Exception:
    """A create's 429 (``RESOURCE_EXHAUSTED``) as :class:`QueueFull`; any other error as it is.

    The Gemini API refuses a job past its concurrent batch jobs (100) or the tokens enqueued for
    the model; Vertex AI past its quota of concurrent batch prediction jobs. A message that
    speaks of tokens is about enqueued tokens, any other about jobs. The ``retryDelay`` it
    asks, if any, is how long the shard waits before it submits again."""
    if getattr(error, "code", None) != 429:
        return error
    message = str(getattr(error, "message", None) or error)
    kind = ENQUEUED_TOKENS if "token" in message.lower() else CONCURRENT_JOBS
    stated = _STATED.search(message)
    limit = {kind: int(stated[1].replace(",", ""))} if stated else {}
    return QueueFull(
        f"{model}: HTTP 429 RESOURCE_EXHAUSTED: {message}",
        kind=kind,
        stated=limit,
        retry_after=retry_delay_seconds(getattr(error, "details", None)),
    )


def retry_delay_seconds(details: Any) -> float | None:
    """The ``retryDelay`` of a Google API error body (``google.rpc.RetryInfo``), in seconds.

    >>> error = {"details": [{"@type": _RETRY_INFO, "retryDelay": "37s"}]}
    >>> retry_delay_seconds({"error": error})
    37.0
    """
    error = details.get("error", details) if isinstance(details, Mapping) else {}
    for detail in error.get("details") or []:
        if isinstance(detail, Mapping) and detail.get("@type") == _RETRY_INFO:
            text = str(detail.get("retryDelay", "")).strip()
            try:
                return max(float(text.removesuffix("s")), 0.0)
            except ValueError:
                return None
    return None


class Jobs:
    """What both backends share: poll, cancel, create with the queue's refusal said, and the
    queue (``queue``): one per API, endpoint, key or project, and model. ``concurrent_jobs`` is
    the most batch jobs the model may have at once, when known."""

    name = "gemini"
    limits: Limits

    def __init__(
        self,
        client: genai.Client,
        model: str,
        defaults: Mapping[str, Any],
        concurrent_jobs: int | None = None,
    ) -> None:
        self.client = client
        self.model = model
        self.defaults = dict(defaults)
        api = client._api_client
        where = (api.vertexai, api._http_options.base_url, api.api_key, api.project, api.location)
        stated = {CONCURRENT_JOBS: concurrent_jobs} if concurrent_jobs else {}
        self.queue = Queue(queue_key(self.name, *where, model), stated)

    def _create(self, src: Any, tag: str, dest: str | None = None) -> str:
        from google.genai import types

        config = types.CreateBatchJobConfig(display_name=tag, dest=dest)
        retry = self.client._api_client._http_options.retry_options
        if retry is not None:
            # A 429 on create is a full queue: it reaches the shard at once (``QueueFull``, with
            # the retryDelay Google asks), instead of being retried by the client for a minute.
            codes = [c for c in retry.http_status_codes or _CLIENT_RETRIES if c != 429]
            options = types.HttpOptions(
                retry_options=retry.model_copy(update={"http_status_codes": codes})
            )
            config.http_options = options
        try:
            job = self.client.batches.create(model=self.model, src=src, config=config)
        except Exception as e:
            raise _queue_full(e, self.model) from e
        assert job.name is not None
        return job.name

    def poll(self, batch_id: str) -> Status:
        return _status(self.client.batches.get(name=batch_id))

    def cancel(self, batch_id: str) -> None:
        self.client.batches.cancel(name=batch_id)


class GeminiBatches(Jobs):
    """The Gemini API's Batch Mode for ``model``: inline below ``inline_max_bytes``, else a
    JSONL file through the Files API."""

    def __init__(
        self,
        client: genai.Client,
        model: str,
        defaults: Mapping[str, Any] | None = None,
        limits: Limits = GEMINI_LIMITS,
        *,
        inline_max_bytes: int = INLINE_MAX_BYTES,
        concurrent_jobs: int | None = None,
    ) -> None:
        super().__init__(client, model, defaults or {}, concurrent_jobs)
        self.limits = limits
        self.inline_max_bytes = inline_max_bytes

    def _line(self, request: Request) -> bytes:
        body = with_defaults(checked(request.body), self.defaults)
        line = {"key": request.custom_id, "request": body}
        return json.dumps(line, separators=(",", ":")).encode() + b"\n"

    def size(self, request: Request) -> int:
        return len(self._line(request))

    def upload(self, requests: Sequence[Request], tag: str) -> str | None:
        data = b"".join(self._line(r) for r in requests)
        if len(data) < self.inline_max_bytes:
            return None  # the create takes them inline
        from google.genai import types

        config = types.UploadFileConfig(display_name=tag, mime_type="jsonl")
        uploaded = self.client.files.upload(file=io.BytesIO(data), config=config)
        assert uploaded.name is not None
        return uploaded.name

    def create(self, requests: Sequence[Request], upload: str | None, tag: str) -> str:
        from google.genai import types

        if upload is not None:
            return self._create(upload, tag)
        if not requests:
            raise ValueError(f"submission {tag}: an inline batch job needs its requests")
        inline = [
            types.InlinedRequest(
                **sdk_arguments(with_defaults(r.body, self.defaults)),
                metadata={"key": r.custom_id},
            )
            for r in requests
        ]
        return self._create(inline, tag)

    def find(self, tag: str, since: float) -> str | None:
        pager = self.client.batches.list(config={"page_size": 100})
        while True:
            jobs = list(pager.page)
            for job in jobs:
                if job.display_name == tag and created_since(job.create_time, since):
                    return job.name
            if not jobs or all(not created_since(j.create_time, since) for j in jobs):
                return None
            try:
                pager.next_page()
            except IndexError:  # the last page
                return None

    def results(self, batch_id: str) -> Iterator[Result]:
        job = self.client.batches.get(name=batch_id)
        dest = job.dest
        if dest is None:
            return
        for inlined in dest.inlined_responses or []:
            custom = str((inlined.metadata or {}).get("key"))
            if inlined.error is not None:
                yield error_result(custom, inlined.error.model_dump(exclude_none=True))
            elif inlined.response is not None:
                yield Result(custom, response_body(inlined.response))
        if dest.file_name:
            yield from self._file_results(dest.file_name)

    def _file_results(self, file_name: str) -> Iterator[Result]:
        with tempfile.TemporaryFile() as spool:
            download = self.client.files.download
            if "destination" in inspect.signature(download).parameters:
                download(file=file_name, destination=spool)  # streamed to disk (google-genai 3)
            else:
                spool.write(download(file=file_name))  # google-genai 2 reads it whole
            spool.seek(0)
            for raw in spool:
                if raw.strip():
                    yield _line_result(json.loads(raw))


def _line_result(line: Mapping[str, Any]) -> Result:
    """One line of a Batch Mode responses file: ``{"key", "response"}`` or ``{"key", "error"}``."""
    custom = str(line.get("key"))
    if line.get("error"):
        return error_result(custom, line["error"])
    response = line.get("response")
    if not isinstance(response, dict):
        return Result(custom, None, f"no response in the responses file's line: {line!r}")
    return Result(custom, response)
