"""What a provider's batch API must do for a checkpointed asset: the ``BatchProvider`` protocol.

Providers sell the calls of a row-wise job for about half the price through their batch APIs
(OpenAI's Batch API, Anthropic's Message Batches). The requests are *submitted* together, the
provider works on them within a window (24 h), and the results are collected later.

This module is the one shape both APIs take here. An adapter per provider implements it with the
provider's own client (``resources/openai.py``'s ``OpenAIResource.batch_provider()``, and
Anthropic's). ``provider_batches.py`` drives it. The asset finds the adapter through a Dagster
resource with a ``batch_provider(endpoint: str | None = None) -> BatchProvider`` method.
``endpoint`` is the provider's API path for every request, such as ``"/v1/embeddings"``; None
means its default.

The adapter does its own retries of transient HTTP errors (the client's ``max_retries`` or its
own). Every method may be called again after a crash and must be safe to repeat. The one
exception is ``create``: the engine never calls it twice for one tag without ``find`` first. This
module imports nothing else of the package: the adapters in ``resources/`` import it and nothing
more of the engine.

A submission is tagged, so that a run that died anywhere finds it again instead of paying for it
twice. The tag (``ca`` and 32 hex digits) is recorded in the checkpoint *before* anything is sent;
the provider's side carries it too: OpenAI's batch ``metadata`` (``TAG_KEY``), and every request's
``custom_id``, which is ``<tag>-<i>`` (``custom_id()``; ``i`` is the row's index in the
submission) and matches both providers' rules (``[a-zA-Z0-9_-]{1,64}``).

The call sequence for one submission (each step's result recorded before the next is sent):

- ``size(request)``, for each request: rows are split into submissions within ``limits``
  (requests and bytes).
- ``upload(requests, tag) -> str | None``: a file the provider keeps (OpenAI), or None when
  ``create`` takes the requests itself (Anthropic).
- ``create(requests, upload, tag) -> str``: the provider's batch id.
- ``find(tag, since) -> str | None``, after a crash: the batch created with ``tag``.
- ``poll(batch_id) -> Status``.
- ``results(batch_id) -> Iterator[Result]``, once the state is not RUNNING.
- ``cancel(batch_id)``.

Queue room. Providers bound what may wait in their queue at once: tokens enqueued per model
(OpenAI), requests waiting (Anthropic), jobs running (Bedrock, Vertex). A batch that does not fit
is refused as a whole and nothing of it runs or is billed. The adapter says so by raising
:class:`QueueFull` from ``create``, or by a ``poll`` whose state is ``REFUSED`` (a batch created,
then refused at validation). The engine records the submission as refused, keeps its rows
unsubmitted, and submits them again once there is room (``queue.py``). An adapter whose
provider has such a queue may also have ``queue``, a :class:`Queue`: which queue it is and the
limits its resource states.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, runtime_checkable

TAG_KEY: Final = "checkpoint_assets_submission"  # the key of the tag in a batch's metadata
# Both providers end a batch within 24 hours of its creation (expired, if it is not done).
WINDOW_SECONDS: Final = 24 * 3600


class State(enum.StrEnum):
    """Where a submission stands on the provider's side."""

    RUNNING = "running"  # accepted, validating, in progress, finalizing or cancelling
    ENDED = "ended"  # every request has its result (a response or an error)
    EXPIRED = "expired"  # the window passed: the requests without a result go back to the rows
    CANCELLED = "cancelled"  # cancelled: the requests without a result go back to the rows
    FAILED = "failed"  # refused as a whole (validation): no request ran, ``Status.detail`` says why
    REFUSED = "refused"  # no room in the provider's queue: no request ran, ``Status.refusal`` says


@dataclass(frozen=True)
class Status:
    """One poll of a submission: its state and the provider's request counts."""

    state: State
    succeeded: int = 0
    failed: int = 0
    total: int = 0
    detail: str = ""  # the provider's words about the state (validation errors)
    refusal: QueueFull | None = None  # REFUSED: the provider's words and what it stated


#: The kinds of queue limit, as a :class:`Queue` and :class:`QueueFull` name them.
ENQUEUED_TOKENS: Final = "enqueued_tokens"  # input tokens of the batches waiting (per model)
QUEUED_REQUESTS: Final = "queued_requests"  # requests of the batches waiting
CONCURRENT_JOBS: Final = "concurrent_jobs"  # batches waiting or running
KINDS: Final = (ENQUEUED_TOKENS, QUEUED_REQUESTS, CONCURRENT_JOBS)


@dataclass(frozen=True)
class Queue:
    """One provider queue: ``key`` names it (the account, endpoint and model, hashed: never a
    secret), ``limits`` what may wait in it at once, by kind (``KINDS``), as the resource states
    them. Every submission to one key shares its queue, whichever shard or process sends it."""

    key: str
    limits: Mapping[str, int] = field(default_factory=dict)


def queue_key(*parts: Any) -> str:
    """A queue's key from what names it (URL, key, model): a hash, so no secret is written.

    >>> len(queue_key("https://api.openai.com/v1", "sk-...", "gpt-4o-mini"))
    24
    """
    text = "\n".join(str(p) for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class QueueFull(Exception):
    """The provider refused a submission for want of room in its queue.

    Nothing of it ran and nothing is billed. ``kind`` is the limit it is about (``KINDS``), when
    the adapter knows; ``stated`` holds the limits the provider's message states (by kind),
    ``retry_after`` the seconds it asked to wait, when it says.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str | None = None,
        stated: Mapping[str, int] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.stated = dict(stated or {})
        self.retry_after = retry_after


@dataclass(frozen=True)
class Limits:
    """The most one submission may hold: requests, and bytes (as counted by ``size``)."""

    max_requests: int
    max_bytes: int


@dataclass(frozen=True, slots=True)
class Request:
    """One row's request: its ``custom_id`` and the body the user's ``request(row)`` built
    (the adapter adds what its resource sends with every request, such as ``model``)."""

    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Result:
    """One request's result: the response body of a success, or why it failed.

    ``retry`` is set when the provider says the same request may succeed when sent again: a
    server error, an overload, a rate limit, a timeout. It is unset for a request the provider
    refuses, such as an invalid one.
    """

    custom_id: str
    body: dict[str, Any] | None
    error: str | None = None
    retry: bool = False


@runtime_checkable
class BatchProvider(Protocol):
    """A provider's batch API, as a checkpointed asset drives it (see the module docstring)."""

    name: str  # "openai", "anthropic": in messages, metadata and the job's fingerprint
    limits: Limits

    def size(self, request: Request) -> int:
        """The bytes ``request`` takes in a submission (a JSONL line for OpenAI)."""
        ...

    def upload(self, requests: Sequence[Request], tag: str) -> str | None:
        """Send the requests' file, named after ``tag``; its id, or None when ``create`` takes
        the requests itself."""
        ...

    def create(self, requests: Sequence[Request], upload: str | None, tag: str) -> str:
        """Create the batch tagged ``tag`` and return its id. ``upload`` is what ``upload``
        returned (then ``requests`` may be empty: the file of an earlier run is reused).
        :class:`QueueFull` when the provider's queue has no room for it."""
        ...

    def find(self, tag: str, since: float) -> str | None:
        """The id of the batch created with ``tag`` at or after ``since``, or None if there is none.

        ``since`` is in seconds since the epoch, a little before the tag was recorded.
        """
        ...

    def poll(self, batch_id: str) -> Status:
        """The state and request counts of the batch: one cheap request."""
        ...

    def results(self, batch_id: str) -> Iterator[Result]:
        """The results of a batch that is no longer RUNNING, in any order.

        There is one per request that ran: a success or an error, with ``retry`` set for a
        transient one. Requests that an expiry or a cancel left unrun have none.
        """
        ...

    def cancel(self, batch_id: str) -> None:
        """Ask the provider to cancel the batch (its state becomes CANCELLED later)."""
        ...


def custom_id(tag: str, index: int) -> str:
    """The ``custom_id`` of the row at ``index`` of the submission ``tag``.

    >>> custom_id("ca0123", 7), index_of("ca0123-7", "ca0123")
    ('ca0123-7', 7)
    """
    return f"{tag}-{index}"


def index_of(custom: str, tag: str) -> int | None:
    """The row index of a ``custom_id`` of the submission ``tag`` (None for another's)."""
    prefix, _, index = custom.rpartition("-")
    return int(index) if prefix == tag and index.isdigit() else None
