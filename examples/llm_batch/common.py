"""What the local provider's two APIs share: its state (the batches, the counts of ``/stats``),
bringing a batch up to the clock, and the reading of calls (refusals, paging).

Each API (``openai_api.py``, ``anthropic_api.py``) keeps its batches in :class:`Ledger` and
answers its routes through :func:`answering`, which turns a :class:`Refused` raised anywhere in a
handler into the API's error shape and counts it.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from examples.llm_batch.jobs import ENDED, Answerer, Job, Phase, Settings

DAY: Final = 24 * 3600


class Refused(Exception):
    """A call refused with ``status``, the API's error ``kind`` (its type) and a message."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.retry_after = retry_after  # seconds, sent as retry-after(-ms) when set


class Ledger:
    """The provider's state: the batches of both APIs, in creation order, and the counts.

    All of it is touched from the server's event loop only, so it needs no lock. ``clock`` gives
    the time (seconds since the epoch) that batches move by.
    """

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.time) -> None:
        self.settings, self.clock = settings, clock
        self.counts: Counter[str] = Counter()
        self.answerer = Answerer(settings, self.counts)
        self.batches: dict[str, Job] = {}  # OpenAI's
        self.message_batches: dict[str, Job] = {}  # Anthropic's

    def settle(self, job: Job, now: float) -> Phase:
        """Answer what is done by ``now``; once the batch has ended, count its unrun requests
        and call its ``on_end`` (both once)."""
        job.advance(now, self.answerer)
        phase = job.phase(now)
        if phase in ENDED and not job.settled:
            job.settled = True
            unrun = len(job.requests) - len(job.outcomes) if not job.problems else 0
            if phase is Phase.EXPIRED:
                self.counts["expired"] += unrun
            elif phase is Phase.CANCELLED:
                self.counts["cancelled"] += unrun
            if job.on_end is not None:
                job.on_end(job, phase)
        return phase

    def settle_all(self) -> None:
        now = self.clock()
        for job in [*self.batches.values(), *self.message_batches.values()]:
            self.settle(job, now)

    def shuffled(self, job: Job, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``lines`` in an order fixed by the seed and the batch: neither provider promises the
        order of the input."""
        random.Random(f"{self.settings.seed}:{job.id}").shuffle(lines)
        return lines

    @staticmethod
    def find(jobs: dict[str, Job], request: Request, what: str) -> Job:
        """The batch the path names, or a 404."""
        batch_id = request.path_params["id"]
        if batch_id not in jobs:
            raise Refused(404, f"No {what} found with id '{batch_id}'.", "not_found_error")
        return jobs[batch_id]


def waiting(jobs: dict[str, Job], ledger: Ledger) -> list[Job]:
    """The batches of ``jobs`` that still wait in the queue (not ended, not refused)."""
    now = ledger.clock()
    return [j for j in jobs.values() if not j.problems and ledger.settle(j, now) not in ENDED]


def prompt_tokens(body: Any) -> int:
    """The input tokens a queue counts for one request: the bytes of its strings (but the model
    and roles) over 4, rounded up."""
    found: list[str] = []

    def walk(value: Any, key: str = "") -> None:
        if isinstance(value, str) and key not in ("model", "role"):
            found.append(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, k)
        elif isinstance(value, list):
            for v in value:
                walk(v, key)

    walk(body)
    return -(-len("\n".join(found).encode()) // 4)


def answering(route: Route, error: Callable[[Refused], Response], counts: Counter[str]) -> Route:
    """``route`` with its refusals answered by ``error`` (the API's shape) and counted."""
    endpoint: Callable[[Request], Awaitable[Response]] = route.endpoint

    async def answered(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Refused as e:
            counts["refused"] += 1
            return error(e)

    return Route(route.path, answered, methods=route.methods)


def json_object(raw: bytes) -> dict[str, Any]:
    """The JSON object a body holds, or a 400."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise Refused(400, "expected a JSON object as the request body")
    return body


def limit(request: Request, most: int) -> int:
    """The ``limit`` query parameter (default 20), or a 400."""
    text = request.query_params.get("limit", "20")
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise Refused(400, f"limit must be an integer from 1 to {most}, got {text!r}")
    return int(text)


def index(items: list[Any], item_id: str) -> int:
    """Where the item with id ``item_id`` is in ``items``, or a 400."""
    for i, item in enumerate(items):
        if item.id == item_id:
            return i
    raise Refused(400, f"no object with id {item_id!r} to page from")


def page(items: list[Any], after: str | None, size: int) -> tuple[list[Any], bool]:
    """The ``size`` items after the one with id ``after`` (from the start without), and whether
    more follow."""
    start = 0 if after is None else index(items, after) + 1
    return items[start : start + size], start + size < len(items)


def iso(at: float) -> str:
    """An RFC 3339 time, as Anthropic writes them."""
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")
