"""OpenAI's Batch API as a ``BatchProvider`` (``engine/providers/submissions.py``).

It runs on the ``openai`` client.

One submission is one JSONL file uploaded with ``files.create(purpose="batch")``, named
``<tag>.jsonl``. One batch is created from it with ``batches.create``: a 24 h window, the tag in
its ``metadata``. After a crash, the batch is found again by that metadata in ``batches.list``.
That list is read newest first, back only to the time the submission was recorded.

Results come from the batch's output file and its error file, streamed line by line. The output
file holds successes, and requests the endpoint answered with an error status. The error file
also holds requests an expiry or a cancel left unrun (``batch_expired``, ``batch_cancelled``).
Those lines are no results: their rows are submitted again.

An error status the ``openai`` client itself retries (408, 409, 429, 5xx) is a transient error
(``Result.retry``). Any other error status (400 for an invalid request) is not.

Queue room. OpenAI bounds the input tokens enqueued per model (``enqueued_tokens``). A batch past
it is created ``failed`` with the error code ``token_limit_exceeded``, and a message that states
the limit ("Limit: 2,000,000 enqueued tokens"). ``create`` raises :class:`QueueFull` for it (or
for a 429 on create), and ``poll`` answers ``REFUSED`` when validation refuses it later. A 429
whose code is ``insufficient_quota`` is no queue: the account's credit is spent, and the
client's error reaches the engine, which stops the run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from checkpoint_assets.engine.providers.submissions import (
    ENQUEUED_TOKENS,
    TAG_KEY,
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
    import openai

# OpenAI's documented limits of one batch: 50,000 requests and an input file of 200 MB.
LIMITS: Final = Limits(max_requests=50_000, max_bytes=200 * 1000 * 1000)
DEFAULT_ENDPOINT: Final = "/v1/chat/completions"
# The error codes of requests an expiry or a cancel left unrun: no result, to be submitted again.
_UNRUN: Final = frozenset({"batch_expired", "batch_cancelled"})
# The error statuses the openai client retries on its own (``_should_retry``): sent again.
_TRANSIENT: Final = frozenset({408, 409, 429})
_QUEUE_FULL: Final = "token_limit_exceeded"  # a batch's error code: no room in the queue
_STATED: Final = re.compile(r"Limit:\s*([\d,]+)\s*enqueued tokens", re.IGNORECASE)
_STATES: Final = {
    "validating": State.RUNNING,
    "in_progress": State.RUNNING,
    "finalizing": State.RUNNING,
    "cancelling": State.RUNNING,
    "completed": State.ENDED,
    "expired": State.EXPIRED,
    "cancelled": State.CANCELLED,
    "failed": State.FAILED,
}


class OpenAIBatches:
    """OpenAI's Batch API for one ``endpoint``.

    The endpoint is ``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/responses``... Each body
    is completed with ``defaults`` (the resource's model and request settings) where it leaves
    them out. ``enqueued_tokens`` is the organization's limit for the model, when known: the
    queue (``queue``) is shared by every submission to the same URL, key and model."""

    name = "openai"

    def __init__(
        self,
        client: openai.OpenAI,
        endpoint: str = DEFAULT_ENDPOINT,
        defaults: Mapping[str, Any] | None = None,
        limits: Limits = LIMITS,
        enqueued_tokens: int | None = None,
    ) -> None:
        self.client = client
        self.endpoint = endpoint
        self.defaults = dict(defaults or {})
        self.limits = limits
        key = queue_key(self.name, client.base_url, client.api_key, self.defaults.get("model"))
        stated = {ENQUEUED_TOKENS: enqueued_tokens} if enqueued_tokens else {}
        self.queue = Queue(key, stated)
        self._sized: dict[str, bytes] = {}  # lines encoded by ``size``, until uploaded

    def _line(self, request: Request) -> bytes:
        line = self._sized.pop(request.custom_id, None)
        return line if line is not None else self._encode(request)

    def _encode(self, request: Request) -> bytes:
        body = {**self.defaults, **request.body}
        line = {"custom_id": request.custom_id, "method": "POST", "url": self.endpoint}
        return json.dumps({**line, "body": body}, separators=(",", ":")).encode() + b"\n"

    def size(self, request: Request) -> int:
        line = self._sized[request.custom_id] = self._encode(request)
        return len(line)

    def upload(self, requests: Sequence[Request], tag: str) -> str:
        data = b"".join(self._line(r) for r in requests)
        return self.client.files.create(file=(f"{tag}.jsonl", data), purpose="batch").id

    def create(self, requests: Sequence[Request], upload: str | None, tag: str) -> str:
        if upload is None:
            upload = self.upload(requests, tag)
        return self._created(upload, completion_window="24h", metadata={TAG_KEY: tag})

    def _created(self, upload: str, **options: Any) -> str:
        """The id of the batch created from the uploaded file ``upload`` with ``options``. A
        refusal for want of queue room (a 429, or a batch created ``failed`` with
        ``token_limit_exceeded``) raises ``QueueFull``; a spent quota goes through as it is."""
        import openai

        try:
            batch = self.client.batches.create(
                input_file_id=upload,
                endpoint=self.endpoint,  # type: ignore[arg-type]  # the client lists known ones
                **options,
            )
        except openai.RateLimitError as e:
            if _code(e) == "insufficient_quota":
                raise  # the account's credit: no queue, waiting does not help
            raise _refusal(e) from e
        errors = batch.errors.data if batch.errors and batch.errors.data else []
        if batch.status == "failed" and any(e.code == _QUEUE_FULL for e in errors):
            raise _queue_full(batch.id, errors)
        return batch.id

    def find(self, tag: str, since: float) -> str | None:
        for batch in self.client.batches.list(limit=100):  # newest first, page by page
            if (batch.metadata or {}).get(TAG_KEY) == tag:
                return batch.id
            if batch.created_at < since:
                return None
        return None

    def poll(self, batch_id: str) -> Status:
        batch = self.client.batches.retrieve(batch_id)
        counts = batch.request_counts
        errors = batch.errors.data if batch.errors and batch.errors.data else []
        if batch.status == "failed" and any(e.code == _QUEUE_FULL for e in errors):
            refusal = _queue_full(batch_id, errors)
            return Status(State.REFUSED, detail=refusal.message, refusal=refusal)
        return Status(
            _STATES.get(batch.status, State.RUNNING),
            succeeded=counts.completed if counts else 0,
            failed=counts.failed if counts else 0,
            total=counts.total if counts else 0,
            detail="; ".join(f"{e.code}: {e.message}" for e in errors[:5]),
        )

    def results(self, batch_id: str) -> Iterator[Result]:
        batch = self.client.batches.retrieve(batch_id)
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                with self.client.with_streaming_response.files.content(file_id) as response:
                    for line in response.iter_lines():
                        found = json.loads(line) if line.strip() else None
                        if (
                            found is not None
                            and (found.get("error") or {}).get("code") not in _UNRUN
                        ):
                            yield _result(found)

    def cancel(self, batch_id: str) -> None:
        self.client.batches.cancel(batch_id)


def _queue_full(batch_id: str, errors: Sequence[Any]) -> QueueFull:
    """The refusal of a batch failed with ``token_limit_exceeded``, with the limit it states."""
    message = next(e.message or "" for e in errors if e.code == _QUEUE_FULL)
    stated = _STATED.search(message)
    limit = {ENQUEUED_TOKENS: int(stated[1].replace(",", ""))} if stated else {}
    return QueueFull(
        f"batch {batch_id}: {_QUEUE_FULL}: {message}", kind=ENQUEUED_TOKENS, stated=limit
    )


def _code(e: Any) -> Any:
    body = e.body if isinstance(e.body, dict) else {}
    return body.get("code") or getattr(e, "code", None)


def _refusal(e: Any) -> QueueFull:
    """A 429 on create, other than ``insufficient_quota``: no room in the queue."""
    body = e.body if isinstance(e.body, dict) else {}
    message = str(body.get("message") or e)
    stated = _STATED.search(message)
    limit = {ENQUEUED_TOKENS: int(stated[1].replace(",", ""))} if stated else {}
    after = e.response.headers.get("retry-after") if e.response is not None else None
    return QueueFull(
        f"HTTP 429: {message}", kind=ENQUEUED_TOKENS, stated=limit, retry_after=_seconds(after)
    )


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _result(line: Mapping[str, Any]) -> Result:
    """One line of an output or error file as a ``Result``."""
    custom = str(line.get("custom_id"))
    error = line.get("error")
    response = line.get("response") or {}
    body = response.get("body")
    if error:
        return Result(custom, None, f"{error.get('code')}: {error.get('message')}")
    status = int(response.get("status_code") or 0)
    if status != 200 or not isinstance(body, dict):
        detail = body.get("error", body) if isinstance(body, dict) else body
        if isinstance(detail, dict):
            detail = detail.get("message", detail)
        retry = status in _TRANSIENT or status >= 500
        return Result(custom, None, f"HTTP {status}: {detail}", retry=retry)
    return Result(custom, body)
