"""Submitting a provider run's rows: the backlog of rows to submit, the room in the provider's
queue, each submission's record, reserved cost and upload, and the refusals for want of room.

:class:`Submitting` is the part of :class:`~checkpoint_assets.engine.providers.provider_batches.
ProviderRun` that submits; ``provider_batches.py`` says how the run goes.
"""

from __future__ import annotations

import json
import time
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls.batches import Check
from checkpoint_assets.engine.calls.refusals import quota_spent
from checkpoint_assets.engine.errors import (
    BudgetExceededError,
    FunctionError,
    QuotaExhaustedError,
)
from checkpoint_assets.engine.loop.shard_run import ShardRun
from checkpoint_assets.engine.providers.handoff import Handoff
from checkpoint_assets.engine.providers.job import ProviderJob
from checkpoint_assets.engine.providers.queue import Claim, SharedQueue, Use, enough, kind_of
from checkpoint_assets.engine.providers.splits import Room, Split, rows_of, splits
from checkpoint_assets.engine.providers.submission_records import Records, Submission
from checkpoint_assets.engine.providers.submissions import (
    CONCURRENT_JOBS,
    ENQUEUED_TOKENS,
    QUEUED_REQUESTS,
    BatchProvider,
    QueueFull,
    State,
)


class Submitting(ShardRun):
    """Submitting the rows of a provider run (see the module docstring)."""

    job: ProviderJob  # set by ProviderRun.__init__
    # Set by ProviderRun.work before anything is submitted or collected.
    provider: BatchProvider
    records: Records
    check: Check
    todo: pl.DataFrame  # keys (id, input hash, position) of the rows to do
    attempts: dict[Any, int]  # rows to do that no collected result covers yet: their calls so far
    reserved: dict[str, float]  # the estimates of this run's submissions, by tag
    refused: BudgetExceededError | None  # a submission the budget did not take
    handoff: Handoff  # rows finished online, batches cancelled
    queue: SharedQueue
    checkpoint_name: str
    backlog: list[tuple[pl.DataFrame, int]]  # rows to submit (keys) and their attempt, oldest first
    room_at: float  # no submission before this time (monotonic): a refusal asked to wait
    tokens_per_row: float | None  # of the submissions made, for the room needed
    noted_waiting: int  # the rows waiting for room last recorded (-1: unknown)

    def _submit_backlog(self) -> list[Submission]:
        """Submit the rows of the backlog that the provider's limits and its queue's room take,
        oldest first, until the room or the spend budget runs out (see the module docstring)."""
        made: list[Submission] = []
        while self.backlog and self.refused is None:
            keys, attempt = self.backlog[0]
            keys = keys.filter(pl.col(self.id).is_in(list(self.attempts)))  # not stored since
            if keys.height == 0:
                self.backlog.pop(0)
                continue
            room = self._room(keys.height)
            if room is None:
                break
            sent: list[Any] = []
            for split in splits(
                self.provider, rows_of(self.prepared, keys), self._body, self.id, room
            ):
                s = self._claimed_send(split, attempt)
                if s is None:
                    break
                made.append(s)
                sent += split.ids
                per_row = split.tokens / len(split.ids)
                self.tokens_per_row = max(self.tokens_per_row or 0.0, per_row)
            left = keys.filter(~pl.col(self.id).is_in(sent)) if sent else keys
            if left.height:
                self.backlog[0] = (left, attempt)
                break  # the room, or the budget, ran out before these rows
            self.backlog.pop(0)
        return made

    def _room(self, rows: int) -> Room | None:
        """The room the next submissions of ``rows`` rows may take in the provider's queue, or
        None when they should wait (too little room, or a refusal asked to wait)."""
        if time.monotonic() < self.room_at:
            return None
        claims = self.queue.claims()
        limits = self.queue.limits()
        if not limits:
            return Room()  # unknown: the claims take turns until a refusal states the limit
        tokens = self.tokens_per_row
        need = Use(rows * int(tokens + 1) if tokens else 2**62, rows, 1)
        room = self.queue.room(claims)
        assert room is not None
        if not enough(room, limits, need):
            # Room frees when batches end, not when collected: poll the batches of the claims.
            claims = self.queue.claims(poll=True)
            room = self.queue.room(claims)
            assert room is not None
            if not enough(room, limits, need):
                return None
        return Room(room.get(QUEUED_REQUESTS), room.get(ENQUEUED_TOKENS), room.get(CONCURRENT_JOBS))

    def _claimed_send(self, split: Split, attempt: int) -> Submission | None:
        """Claim ``split``'s room in the queue, reserve its cost, send it; None when the queue or
        the budget has no room for it (it stays in the backlog)."""
        claim = Claim(split.tag, self.checkpoint_name, split.tokens, len(split.requests))
        if not self.queue.take(claim):
            self.room_at = time.monotonic() + self.queue.step_back()
            return None
        if not self._reserve(split):
            self.queue.release(split.tag)
            return None
        tag, requests = split.tag, split.requests
        s = Submission(
            tag, self.provider.name, split.ids, split.hashes, attempt=attempt, tokens=split.tokens
        )
        self.records.record_intent(s)
        try:
            file_id = self.provider.upload(requests, tag)
            if file_id is not None:
                self.records.advance(s, "uploaded", file_id=file_id)
            batch_id = self.provider.create(requests, file_id, tag)
        except QueueFull as e:
            self._refused(s, e)
            return None
        except Exception as e:
            spent = quota_spent(e)
            if spent is None:
                raise
            # Its record stays open: the next run finds or creates its batch.
            self.queue.release(split.tag)
            raise QuotaExhaustedError(self.label, spent, self.done_rows, stated=True) from e
        self.records.advance(s, "created", batch_id=batch_id)
        self.queue.created(claim, batch_id)
        self.stats.calls += len(requests)
        self.log.info(
            "%s: submitted %d rows to %s as batch %s (submission %s).",
            self.label,
            len(requests),
            self.provider.name,
            batch_id,
            tag,
        )
        return s

    def _refused(self, s: Submission, refusal: QueueFull) -> None:
        """The provider had no room for ``s`` in its queue: record it refused (nothing ran, nothing
        is billed), free its claim and reservation, and write down what the refusal says."""
        self.records.advance(s, "refused", note=refusal.message)
        # What it teaches is written before its claim goes, so no shard sends into the gap.
        used = self.queue.used([c for c in self.queue.claims() if c.tag != s.tag])
        learned = self.queue.learn(refusal, kind_of(refusal, self.queue.queue), used)
        self.queue.release(s.tag)
        if self.spend is not None:
            self.spend.release(self.reserved.pop(s.tag, 0.0))
        self.stats.submissions_refused += 1
        wait = refusal.retry_after if refusal.retry_after is not None else 0.0
        if not learned and not self.queue.limits():
            wait = max(wait, self.job.poll_seconds)  # nothing known of the queue: wait a while
        self.room_at = max(self.room_at, time.monotonic() + wait)
        known = ", ".join(f"{k} {v:,}" for k, v in self.queue.limits().items()) or "not stated"
        self.log.warning(
            "%s: %s had no room in its queue for submission %s (%d rows): %s. Nothing of it ran "
            "or is billed; its rows are submitted again once the queue has room (its limit: %s).",
            self.label,
            self.provider.name,
            s.tag,
            len(s.ids),
            refusal.message.rstrip(". "),
            known,
        )

    def _ended(self, batch_id: str) -> bool:
        """Whether ``batch_id`` (any shard's) has left the queue; False when the poll fails."""
        try:
            return self.provider.poll(batch_id).state is not State.RUNNING
        except Exception:
            return False

    def _reserve(self, split: Split) -> bool:
        """Reserve the estimated cost of ``split`` in the spend budget; False when it does not
        fit (``refused`` says why)."""
        if self.spend is None:
            return True
        # The adapters in resources/ complete each body with their resource's defaults (model,
        # max_tokens); the protocol does not require them.
        defaults = getattr(self.provider, "defaults", None) or {}
        estimate = split.estimate(self.spend.budget, defaults)
        try:
            self.spend.reserve(estimate)
        except BudgetExceededError as e:
            self.refused = e
            self.refused.estimate = estimate
            return False
        self.reserved[split.tag] = estimate
        return True

    def _body(self, row: dict[str, Any]) -> dict[str, Any]:
        try:
            body = self.job.request(row)
        except Exception as e:
            problem = f"request() raised {type(e).__name__}: {e} for the row {row[self.id]!r}"
            raise FunctionError(self.label, problem, self.done_rows) from e
        if not isinstance(body, dict):
            problem = f"request() returned {type(body).__name__}; it must return a dict (the body)"
            raise FunctionError(self.label, problem, self.done_rows)
        return body

    def _note_waiting(self, rows: int) -> None:
        """Record in the checkpoint how many rows wait for queue room (``checkpoint-assets
        status`` shows it); nothing is written while the count stays the same."""
        if rows == self.noted_waiting:
            return
        store, path = self.records.store, self.records.files.queue_waiting
        if rows:
            store.put(path, json.dumps({"rows": rows, "at": time.time()}).encode())
        else:
            store.delete([path])
        self.noted_waiting = rows

    def _unsubmitted(self) -> int:
        """Rows of the backlog still to submit (none once the budget refused a submission)."""
        if self.refused is not None:
            return 0
        return sum(keys.height for keys, _ in self.backlog)

    def _back(self, ids: list[Any], attempt: int) -> None:
        """Put the rows ``ids`` (those not stored) back in the backlog at ``attempt``."""
        ids = [i for i in ids if i in self.attempts]
        keys = self.todo.filter(pl.col(self.id).is_in(ids))
        if keys.height:
            self.backlog.append((keys, attempt))
