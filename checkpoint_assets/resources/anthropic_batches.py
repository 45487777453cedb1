"""Anthropic's Message Batches as a ``BatchProvider`` (``engine/providers/submissions.py``).

It runs on the ``anthropic`` client.

One submission is one message batch, created with its requests in the call itself. There is no
file: ``upload`` returns None. Every request's ``custom_id`` is ``<tag>-<i>``. That prefix is the
only tag a message batch can carry, since Anthropic batches take no metadata.

Finding a batch again after a crash (``find``). A run may die between sending the create and
recording the batch id. It leaves a batch that only its requests name. Anthropic shows a batch's
requests only in its results, once it has ended. So ``find`` works this way:

- It lists the batches created since the submission's intent, newest first.
- For each that has ended, it reads the first line of its results. A ``custom_id`` starting with
  the tag marks this submission's batch.
- A batch still processing cannot be told apart yet. ``find`` polls it (with backoff) until it
  ends, for at most ``find_wait_seconds``. Then it stops with :class:`SubmissionUndecidedError`,
  having sent nothing. A later run decides once those batches have ended.
- ``find`` answers None (the submission never reached Anthropic) only when every batch of that
  window has ended and none is tagged.

Results stream from the batch's results URL line by line:

- ``succeeded`` lines give the message (as the API sent it) as the body;
- ``errored`` lines give an error;
- ``canceled`` and ``expired`` lines are not results, so the engine submits those rows again.

An error of a server, an overload, a rate limit or a timeout is transient (``Result.retry``).
Anthropic asks that an ``invalid_request_error`` be fixed before it is sent again, so it is not.

Queue room. Anthropic bounds the batch requests waiting in a workspace's processing queue
(``queued_requests``), and answers a create past it with 429. ``create`` raises
:class:`QueueFull` for a 429 (after the client's own retries), with the limit its message states
and the wait its ``retry-after`` asks, when they are there.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from checkpoint_assets.engine.providers.submissions import (
    QUEUED_REQUESTS,
    Limits,
    Queue,
    QueueFull,
    Request,
    Result,
    State,
    Status,
    index_of,
    queue_key,
)

if TYPE_CHECKING:
    import anthropic
    from anthropic.types.messages import MessageBatch

__all__ = ["LIMITS", "AnthropicBatches", "SubmissionUndecidedError"]

# Anthropic's documented limits of one message batch: 100,000 requests and 256 MB, the create's
# whole body; ``size`` counts the requests, so the envelope around them is kept out of the bytes.
LIMITS: Final = Limits(max_requests=100_000, max_bytes=256 * 1000 * 1000 - 1024)
ENDPOINT: Final = "/v1/messages"
# The error types of an ``errored`` request worth sending again as it is.
_TRANSIENT: Final = frozenset(
    {"api_error", "overloaded_error", "rate_limit_error", "timeout_error"}
)
_log = logging.getLogger("checkpoint_assets")
_STATED: Final = re.compile(r"limit(?: of|:)\s*([\d,]+)", re.IGNORECASE)


class SubmissionUndecidedError(RuntimeError):
    """A submission's batch may exist on Anthropic, among batches still processing.

    Those batches cannot be told apart from others until they end. Nothing was sent again."""


class AnthropicBatches:
    """Anthropic's Message Batches, each request's ``params`` completed with ``defaults`` (the
    resource's ``model`` and ``max_tokens``) where the body leaves them out. ``queued_requests``
    is the workspace's limit of batch requests waiting, when known: the queue (``queue``) is
    shared by every submission to the same URL and key."""

    name = "anthropic"

    def __init__(
        self,
        client: anthropic.Anthropic,
        defaults: Mapping[str, Any] | None = None,
        limits: Limits = LIMITS,
        *,
        queued_requests: int | None = None,
        find_wait_seconds: float = 900.0,
        find_poll_seconds: float = 5.0,
    ) -> None:
        self.client = client
        self.defaults = dict(defaults or {})
        self.limits = limits
        stated = {QUEUED_REQUESTS: queued_requests} if queued_requests else {}
        self.queue = Queue(queue_key(self.name, client.base_url, client.api_key), stated)
        self.find_wait_seconds = find_wait_seconds
        self.find_poll_seconds = find_poll_seconds

    def _entry(self, request: Request) -> dict[str, Any]:
        return {"custom_id": request.custom_id, "params": {**self.defaults, **request.body}}

    def size(self, request: Request) -> int:
        # One entry of the create's ``requests`` list and the comma after it, encoded as the
        # client encodes its body (compact, UTF-8).
        entry = json.dumps(self._entry(request), ensure_ascii=False, separators=(",", ":"))
        return len(entry.encode()) + 1

    def upload(self, requests: Sequence[Request], tag: str) -> None:
        return None  # the create takes the requests itself

    def create(self, requests: Sequence[Request], upload: str | None, tag: str) -> str:
        if not requests:
            raise ValueError(f"submission {tag}: a message batch needs its requests")
        import anthropic

        entries = [self._entry(r) for r in requests]
        try:
            return self.client.messages.batches.create(requests=entries).id  # type: ignore[arg-type]
        except anthropic.RateLimitError as e:
            message = _message(e)
            stated = _STATED.search(message)
            limit = {QUEUED_REQUESTS: int(stated[1].replace(",", ""))} if stated else {}
            after = e.response.headers.get("retry-after")
            raise QueueFull(
                f"HTTP 429: {message}",
                kind=QUEUED_REQUESTS,
                stated=limit,
                retry_after=_seconds(after),
            ) from e

    def find(self, tag: str, since: float) -> str | None:
        waiting = self._created_since(since)
        deadline = time.monotonic() + self.find_wait_seconds
        delay = self.find_poll_seconds
        while True:
            running = []
            for batch in waiting:
                if batch.processing_status != "ended":
                    running.append(batch.id)
                elif self._holds(batch.id, tag):
                    return batch.id
            if not running:
                return None
            if time.monotonic() + delay > deadline:
                raise _undecided(tag, since, running)
            _log.info(
                "submission %s: %d message batch(es) created since it was recorded are still "
                "processing (%s); one may be this submission, which only their results show. "
                "Checking again in %.0f s.",
                tag,
                len(running),
                ", ".join(running[:5]),
                delay,
            )
            time.sleep(delay)
            delay = min(delay * 2, 60.0)
            waiting = [self.client.messages.batches.retrieve(i) for i in running]

    def _created_since(self, since: float) -> list[MessageBatch]:
        """The message batches created at or after ``since``, newest first."""
        found = []
        for batch in self.client.messages.batches.list(limit=100):  # newest first, by page
            if batch.created_at.timestamp() < since:
                break
            found.append(batch)
        return found

    def _holds(self, batch_id: str, tag: str) -> bool:
        """Whether the ended batch holds requests of the submission ``tag`` (its first result
        line says: a batch holds the requests of one submission)."""
        for line in self._lines(batch_id):
            return index_of(str(line.get("custom_id")), tag) is not None
        return False

    def poll(self, batch_id: str) -> Status:
        batch = self.client.messages.batches.retrieve(batch_id)
        c = batch.request_counts
        total = c.processing + c.succeeded + c.errored + c.canceled + c.expired
        if batch.processing_status != "ended":
            state = State.RUNNING
        elif c.expired:
            state = State.EXPIRED
        elif c.canceled or batch.cancel_initiated_at is not None:
            state = State.CANCELLED
        else:
            state = State.ENDED
        return Status(state, succeeded=c.succeeded, failed=c.errored, total=total)

    def results(self, batch_id: str) -> Iterator[Result]:
        for line in self._lines(batch_id):
            result = _result(line)
            if result is not None:
                yield result

    def _lines(self, batch_id: str) -> Iterator[dict[str, Any]]:
        results = self.client.messages.batches.with_streaming_response.results(batch_id)
        with results as response:
            for line in response.iter_lines():
                if line.strip():
                    yield json.loads(line)

    def cancel(self, batch_id: str) -> None:
        self.client.messages.batches.cancel(batch_id)


def _result(line: Mapping[str, Any]) -> Result | None:
    """One line of a batch's results as a ``Result``; None for a request that did not run."""
    custom = str(line.get("custom_id"))
    result = line.get("result") or {}
    kind = result.get("type")
    if kind == "succeeded" and isinstance(result.get("message"), dict):
        return Result(custom, result["message"])
    if kind == "errored":
        error = (result.get("error") or {}).get("error") or {}
        kind = error.get("type")
        return Result(custom, None, f"{kind}: {error.get('message')}", kind in _TRANSIENT)
    if kind in ("canceled", "expired"):
        return None
    return Result(custom, None, f"unexpected result in the batch's results: {result!r}")


def _message(e: Any) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    error = body.get("error")
    return str((error.get("message") if isinstance(error, dict) else None) or e)


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _undecided(tag: str, since: float, running: list[str]) -> SubmissionUndecidedError:
    recorded = datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return SubmissionUndecidedError(
        f"Submission {tag} may have been created on Anthropic by a run that stopped before "
        f"recording it: {len(running)} message batch(es) created since {recorded} are still "
        f"processing ({', '.join(running[:5])}{', ...' if len(running) > 5 else ''}), and "
        "Anthropic shows which requests a batch holds only once it has ended. Nothing was "
        "submitted again. Run the shard again once they have ended: the run then finds its "
        "batch, or submits the rows if none of them holds it."
    )
