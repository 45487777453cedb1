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
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from checkpoint_assets.engine.providers.submissions import (
    TAG_KEY,
    Limits,
    Request,
    Result,
    State,
    Status,
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
    them out."""

    name = "openai"

    def __init__(
        self,
        client: openai.OpenAI,
        endpoint: str = DEFAULT_ENDPOINT,
        defaults: Mapping[str, Any] | None = None,
        limits: Limits = LIMITS,
    ) -> None:
        self.client = client
        self.endpoint = endpoint
        self.defaults = dict(defaults or {})
        self.limits = limits
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
        batch = self.client.batches.create(
            input_file_id=upload,
            endpoint=self.endpoint,  # type: ignore[arg-type]  # the client lists the known ones
            completion_window="24h",
            metadata={TAG_KEY: tag},
        )
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
