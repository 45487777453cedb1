"""Room in a provider's queue, shared by every shard that submits to it, through the checkpoint
store they already share.

Providers bound what may wait in their queue at once (``submissions.Queue``): tokens enqueued
per model (OpenAI), requests waiting (Anthropic), jobs (Bedrock, Vertex). A batch past the bound
is refused as a whole. Shards of one backfill, in many processes on many machines, fill one
queue, so each must know what the others have in it. They write it down under the store's root,
``_provider_queues/<queue key>/`` (``layout.queue_folder``):

- ``<tag>.json``, a *claim*: one submission's estimated input tokens and requests, the checkpoint
  it belongs to, when it was claimed, and its batch id once created. Written before the batch is
  created, deleted once it has ended.
- ``limits.json``: the limits the provider's refusals stated, by kind. Each run reads them, so a
  limit one shard learned holds for every shard.

Taking room (``take``): a shard writes its claim, then lists every claim. When all of them
together fit the limits, it creates the batch; otherwise it deletes its claim and waits. Two
shards that claim at once cannot both pass: the later writer's listing sees the earlier claim.
At worst both step back and try again after a random pause. With no limit known (none set, no
refusal stated one), a shard creates only while no other claim is being created, so the first
refusal tells its limit before the next batch is sent.

Room frees when batches end, not when their results are collected: a shard that waits for room
polls the batches of the claims (one request each) and deletes those that have ended, whoever
made them. A claim without a batch older than ``_STALE_SECONDS`` is of a run that stopped before
creating it, and is deleted too.

A refusal may still happen (other jobs on the same account, estimates below the provider's
count). It costs nothing: the submission is recorded as refused, its rows wait, and the limit it
states is written down.
"""

from __future__ import annotations

import json
import math
import posixpath
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Final

from checkpoint_assets.engine.checkpoints.layout import queue_folder
from checkpoint_assets.engine.providers.submissions import (
    CONCURRENT_JOBS,
    ENQUEUED_TOKENS,
    KINDS,
    QUEUED_REQUESTS,
    Queue,
    QueueFull,
)
from checkpoint_assets.engine.storage import Store

_LIMITS: Final = "limits.json"
_STALE_SECONDS: Final = 900.0  # a claim without a batch this old: its run stopped before creating
# A part of the rows left is submitted only into at least this share of the queue's limit, so a
# shard does not send many small batches into the gaps others leave.
MIN_SHARE: Final = 0.1
STEP_BACK_SECONDS: Final = 2.0  # the most a shard pauses after stepping back from a crowded claim


@dataclass(frozen=True)
class Use:
    """What submissions take of a queue, by kind (``submissions.KINDS``)."""

    enqueued_tokens: int = 0
    queued_requests: int = 0
    concurrent_jobs: int = 0

    def __add__(self, other: Use) -> Use:
        return Use(*(getattr(self, k) + getattr(other, k) for k in KINDS))

    def of(self, kind: str) -> int:
        return int(getattr(self, kind))


@dataclass
class Claim:
    """One submission waiting in the queue, as the claim file records it."""

    tag: str
    checkpoint: str
    tokens: int
    requests: int
    at: float = field(default_factory=time.time)
    batch_id: str | None = None

    @property
    def use(self) -> Use:
        return Use(self.tokens, self.requests, 1)


class SharedQueue:
    """One provider queue as the shards that submit to it share it (see the module docstring).

    ``ended(batch_id)`` polls a batch: True once it no longer waits in the queue."""

    def __init__(
        self,
        store: Store,
        queue: Queue,
        ended: Callable[[str], bool],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.queue = queue
        self.folder = queue_folder(store.root, queue.key)
        self.ended = ended
        self.clock = clock
        self.peak = 0.0  # the highest share of a limit the claims took when this run looked

    # -- limits ---------------------------------------------------------------------------
    def limits(self) -> dict[str, int]:
        """The limits in force: the resource's, lowered by any a refusal stated."""
        learned = self._learned()
        out = dict(self.queue.limits)
        for kind, value in learned.items():
            out[kind] = min(out.get(kind, value), value)
        return out

    def _learned(self) -> dict[str, int]:
        try:
            raw = json.loads(self.store.get(posixpath.join(self.folder, _LIMITS)))
        except (FileNotFoundError, ValueError):
            return {}
        return {k: int(v) for k, v in raw.items() if k in KINDS and isinstance(v, int) and v > 0}

    def learn(self, refusal: QueueFull, kind: str | None, used: Use) -> dict[str, int]:
        """Write down what the refusal says of the queue's limits: the limits it states, or,
        when it states none, what waited in the queue when it was refused (``used``, of ``kind``,
        when some did). Returns what was learned."""
        learned = {k: v for k, v in refusal.stated.items() if k in KINDS and v > 0}
        if not learned and kind is not None and used.of(kind) > 0:
            learned = {kind: used.of(kind)}
        if learned:
            limits = self._learned() | learned
            self.store.put(posixpath.join(self.folder, _LIMITS), json.dumps(limits).encode())
        return learned

    # -- claims ---------------------------------------------------------------------------
    def claims(self, poll: bool = False) -> list[Claim]:
        """The claims waiting in the queue. Stale ones are deleted; with ``poll``, so are those
        whose batch has ended (one poll each)."""
        found, gone = [], []
        now = self.clock()
        for info in self.store.list(self.folder):
            if info.name == _LIMITS or not info.name.endswith(".json"):
                continue
            try:
                claim = Claim(**json.loads(self.store.get(info.path)))
            except FileNotFoundError:
                continue  # deleted since the listing
            except (ValueError, TypeError):
                gone.append(info.path)  # unreadable: a torn write of a store without atomic puts
                continue
            stale = claim.batch_id is None and now - claim.at > _STALE_SECONDS
            if stale or (poll and claim.batch_id is not None and self.ended(claim.batch_id)):
                gone.append(info.path)
            else:
                found.append(claim)
        self.store.delete(gone)
        self._note(found)
        return found

    def used(self, claims: list[Claim]) -> Use:
        return sum((c.use for c in claims), Use())

    def room(self, claims: list[Claim]) -> dict[str, int] | None:
        """What is left of each limit in force, or None when no limit is known."""
        limits = self.limits()
        if not limits:
            return None
        used = self.used(claims)
        return {kind: limit - used.of(kind) for kind, limit in limits.items()}

    def take(self, claim: Claim) -> bool:
        """Write ``claim``, and keep it if every claim fits the limits with it (True); else
        delete it (False). Unknown limits: keep it when no other claim is being created."""
        path = self._path(claim.tag)
        self.store.put(path, _dump(claim))
        claims = self.claims()
        limits = self.limits()
        if limits:
            used = self.used(claims)
            fits = all(used.of(kind) <= limit for kind, limit in limits.items())
        else:
            fits = not any(c.batch_id is None and c.tag != claim.tag for c in claims)
        if not fits:
            self.store.delete([path])
        return fits

    def hold(self, claim: Claim) -> None:
        """Write ``claim`` without checking: a submission re-attached, waiting already."""
        self.store.put(self._path(claim.tag), _dump(claim))

    def created(self, claim: Claim, batch_id: str) -> None:
        claim.batch_id = batch_id
        self.store.put(self._path(claim.tag), _dump(claim))

    def forget_unsent(self, checkpoint: str) -> None:
        """Delete ``checkpoint``'s claims whose batch was never recorded. Only the run holding a
        checkpoint's lock claims room for it, so when that run starts such a claim is a stopped
        run's, and would keep the room from the run that sends its rows again; a submission the
        run re-attaches is claimed again (``hold``)."""
        mine = [c for c in self.claims() if c.checkpoint == checkpoint and c.batch_id is None]
        self.store.delete([self._path(c.tag) for c in mine])

    def release(self, tag: str) -> None:
        self.store.delete([self._path(tag)])

    def step_back(self) -> float:
        """A random pause after a claim stepped back, so shards that claimed together part."""
        return random.uniform(0.1, STEP_BACK_SECONDS)

    def _path(self, tag: str) -> str:
        return posixpath.join(self.folder, f"{tag}.json")

    def _note(self, claims: list[Claim]) -> None:
        limits = self.limits()
        used = self.used(claims)
        for kind, limit in limits.items():
            if limit > 0:
                self.peak = max(self.peak, used.of(kind) / limit)


def enough(room: Mapping[str, int], limits: Mapping[str, int], need: Use) -> bool:
    """Whether ``room`` is worth a submission: it takes all of ``need`` (the rows left), or at
    least ``MIN_SHARE`` of each limit (and one job)."""
    for kind, left in room.items():
        wanted = need.of(kind)
        floor = 1 if kind == CONCURRENT_JOBS else math.ceil(MIN_SHARE * limits[kind])
        if left < min(wanted, floor) or left <= 0:
            return False
    return True


def kind_of(refusal: QueueFull, queue: Queue) -> str | None:
    """The kind of limit a refusal is about: the adapter's word, else the one it states, else
    the resource's only one, else None."""
    if refusal.kind is not None:
        return refusal.kind
    if refusal.stated:
        return next(iter(refusal.stated))
    if len(queue.limits) == 1:
        return next(iter(queue.limits))
    return None


def _dump(claim: Claim) -> bytes:
    return json.dumps(asdict(claim), separators=(",", ":")).encode()


__all__ = [
    "CONCURRENT_JOBS",
    "ENQUEUED_TOKENS",
    "MIN_SHARE",
    "QUEUED_REQUESTS",
    "Claim",
    "SharedQueue",
    "Use",
    "enough",
    "kind_of",
]
