"""Anthropic's Message Batches for the local provider, in the shapes the ``anthropic`` client
parses (``types/messages/message_batch*.py``).

A batch is created with its requests in the call (``{"requests": [{custom_id, params}]}``): over
100,000 requests is refused with ``400``, a body over 256 MB with ``413`` ``request_too_large``,
a ``custom_id`` outside ``[a-zA-Z0-9_-]{1,64}`` or used twice with ``400``; ``params`` are
checked as the requests run (a malformed one is ``errored``), as Anthropic does. A batch is
``in_progress`` (its validation included), ``canceling`` after a cancel, then ``ended``; its
``request_counts`` stay all ``processing`` until it ends, and its results (one line per request:
``succeeded``, ``errored``, ``canceled``, ``expired``) are at ``results_url`` once it has.
With ``anthropic_queued_requests`` set, a create whose requests would take the requests of the
batches still processing past it is refused with ``429`` ``rate_limit_error`` and
``retry-after``, as Anthropic's queue limit.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from examples.llm_batch.common import (
    DAY,
    Ledger,
    Refused,
    answering,
    index,
    iso,
    json_object,
    limit,
    page,
    waiting,
)
from examples.llm_batch.jobs import (
    CANCELLABLE,
    ENDED,
    MESSAGES,
    Job,
    Outcome,
    Phase,
    expires,
    jsonl,
)

_CUSTOM_ID: Final = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class MessageBatchAPI:
    """The routes of ``/v1/messages/batches`` on the provider's ``ledger``."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger, self.counts, self.settings = ledger, ledger.counts, ledger.settings

    def routes(self) -> list[Route]:
        routes = [
            Route("/v1/messages/batches", self._create, methods=["POST"]),
            Route("/v1/messages/batches", self._list, methods=["GET"]),
            Route("/v1/messages/batches/{id}", self._retrieve, methods=["GET"]),
            Route("/v1/messages/batches/{id}/cancel", self._cancel, methods=["POST"]),
            Route("/v1/messages/batches/{id}/results", self._results, methods=["GET"]),
        ]
        return [answering(r, _error, self.counts) for r in routes]

    async def _create(self, request: Request) -> Response:
        raw, s = await request.body(), self.settings
        if len(raw) > s.anthropic_max_bytes:
            raise Refused(
                413,
                f"Request is {len(raw):,} bytes; a message batch may be at most "
                f"{s.anthropic_max_bytes:,} bytes. Split its requests across several batches.",
                "request_too_large",
            )
        requests = json_object(raw).get("requests")
        if not isinstance(requests, list) or not requests:
            raise Refused(400, "requests: expected a non-empty list")
        if len(requests) > s.anthropic_max_requests:
            raise Refused(
                400,
                f"requests: {len(requests):,} requests; a message batch may hold at most "
                f"{s.anthropic_max_requests:,}. Split them across several batches.",
            )
        pairs = [_request(i, r) for i, r in enumerate(requests)]
        if len({c for c, _ in pairs}) < len(pairs):
            raise Refused(400, "requests: each custom_id must be unique within the batch")
        now, batches = self.ledger.clock(), self.ledger.message_batches
        queued = sum(len(j.requests) for j in waiting(batches, self.ledger))
        over = s.anthropic_queued_requests and queued + len(pairs) > s.anthropic_queued_requests
        if over or s.refuses(self.counts):
            if over:
                self.counts["queue_refused"] += 1
            raise Refused(
                429,
                f"Number of batch requests in the processing queue would exceed your "
                f"workspace's limit of {s.anthropic_queued_requests or 100_000:,}. Wait for "
                "batches to end, then submit again.",
                "rate_limit_error",
                retry_after=s.queue_retry_after,
            )
        job = Job(
            id=f"msgbatch_{uuid.uuid4().hex[:24]}",
            endpoint=MESSAGES,
            requests=pairs,
            created=now,
            settings=s,
            expiring=expires(s, "anthropic", len(batches) + 1),
        )
        batches[job.id] = job
        self.counts["creates"] += 1
        self.counts["submitted"] += len(pairs)
        queued = sum(len(j.requests) for j in waiting(batches, self.ledger))
        self.counts["queued_peak"] = max(self.counts["queued_peak"], queued)
        return JSONResponse(self._json(job, now, request))

    async def _retrieve(self, request: Request) -> Response:
        job = self.ledger.find(self.ledger.message_batches, request, "message batch")
        self.counts["retrieves"] += 1
        return JSONResponse(self._json(job, self.ledger.clock(), request))

    async def _list(self, request: Request) -> Response:
        jobs = list(reversed(self.ledger.message_batches.values()))
        after, before = request.query_params.get("after_id"), request.query_params.get("before_id")
        size = limit(request, 1000)
        if before is not None:  # the page just before (newer than) ``before``
            end = index(jobs, before)
            start = max(0, end - size)
            shown, has_more = jobs[start:end], start > 0
        else:
            shown, has_more = page(jobs, after, size)
        self.counts["lists"] += 1
        now = self.ledger.clock()
        return JSONResponse(
            {
                "data": [self._json(j, now, request) for j in shown],
                "has_more": has_more,
                "first_id": shown[0].id if shown else None,
                "last_id": shown[-1].id if shown else None,
            }
        )

    async def _cancel(self, request: Request) -> Response:
        job = self.ledger.find(self.ledger.message_batches, request, "message batch")
        now = self.ledger.clock()
        if self.ledger.settle(job, now) not in CANCELLABLE:
            raise Refused(400, f"Message batch {job.id} has ended; it cannot be canceled.")
        job.cancelled_at = now
        self.counts["cancels"] += 1
        return JSONResponse(self._json(job, now, request))

    async def _results(self, request: Request) -> Response:
        job = self.ledger.find(self.ledger.message_batches, request, "message batch")
        phase = self.ledger.settle(job, self.ledger.clock())
        if phase not in ENDED:
            raise Refused(
                400,
                f"Message batch {job.id} is still processing; its results are available once "
                "processing_status is 'ended'.",
            )
        lines = [{"custom_id": o.custom_id, "result": _result(o)} for o in job.outcomes]
        unrun = "expired" if phase is Phase.EXPIRED else "canceled"
        lines += [
            {"custom_id": custom_id, "result": {"type": unrun}}
            for custom_id, _ in job.requests[len(job.outcomes) :]
        ]
        self.counts["downloads"] += 1
        data = jsonl(self.ledger.shuffled(job, lines))
        return Response(data, media_type="application/x-jsonl")

    def _json(self, job: Job, now: float, request: Request) -> dict[str, Any]:
        phase = self.ledger.settle(job, now)
        ended = phase in ENDED
        counts = dict.fromkeys(("processing", "succeeded", "errored", "canceled", "expired"), 0)
        if ended:
            counts["succeeded"] = sum(o.error is None for o in job.outcomes)
            counts["errored"] = len(job.outcomes) - counts["succeeded"]
            unrun = "expired" if phase is Phase.EXPIRED else "canceled"
            counts[unrun] = len(job.requests) - len(job.outcomes)
        else:
            counts["processing"] = len(job.requests)
        status = "ended" if ended else "canceling" if phase is Phase.CANCELLING else "in_progress"
        results = f"{request.base_url}v1/messages/batches/{job.id}/results"
        cancelled = job.cancelled_at
        return {
            "id": job.id,
            "type": "message_batch",
            "processing_status": status,
            "request_counts": counts,
            "created_at": iso(job.created),
            "expires_at": iso(job.created + DAY),
            "ended_at": iso(job.ended_at()) if ended else None,
            "cancel_initiated_at": iso(cancelled) if cancelled is not None else None,
            "archived_at": None,
            "results_url": results if ended else None,
        }


def _request(i: int, request: Any) -> tuple[str, Any]:
    """One entry of a create's ``requests`` as ``(custom_id, params)``, or a 400."""
    entry = request if isinstance(request, dict) else {}
    custom_id, params = entry.get("custom_id"), entry.get("params")
    if not (isinstance(custom_id, str) and _CUSTOM_ID.fullmatch(custom_id)):
        raise Refused(
            400, f"requests.{i}.custom_id: must match ^[a-zA-Z0-9_-]{{1,64}}$, got {custom_id!r}"
        )
    if not isinstance(params, dict):
        raise Refused(400, f"requests.{i}.params: expected an object")
    return custom_id, params


def _result(outcome: Outcome) -> dict[str, Any]:
    if outcome.error is None:
        return {"type": "succeeded", "message": outcome.body}
    kind, message = outcome.error
    kind = "api_error" if outcome.status >= 500 else kind
    error = {"type": "error", "error": {"type": kind, "message": message}}
    return {"type": "errored", "error": error}


def _error(e: Refused) -> Response:
    body = {"type": "error", "error": {"type": e.kind, "message": e.message}}
    headers = {}
    if e.retry_after is not None:
        headers = {
            "retry-after": str(max(1, round(e.retry_after))),
            "retry-after-ms": str(round(e.retry_after * 1000)),
        }
    return JSONResponse(body, status_code=e.status, headers=headers)
