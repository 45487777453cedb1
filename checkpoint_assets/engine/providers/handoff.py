"""The rows a hybrid or online run takes off the batches and finishes online (``job.Way``).

:class:`Handoff` holds the rows gone online, with their calls so far, and the submissions the
run cancelled. A hybrid run cancels its open submissions at its deadline; an online run cancels
those of earlier runs at once. A cancelled submission is collected once it has ended, and its
rows without a result go online.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import polars as pl

from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.loop.shard_run import ShardRun
from checkpoint_assets.engine.providers import online
from checkpoint_assets.engine.providers.job import Mode, ProviderJob
from checkpoint_assets.engine.providers.submission_records import Submission
from checkpoint_assets.engine.rows import ATTEMPTS


class Handoff:
    """The rows of one run that go online, and the submissions it cancelled."""

    def __init__(self, run: ShardRun, job: ProviderJob) -> None:
        self.run = run
        self.job = job
        self.rows: dict[Any, int] = {}  # rows to finish online, with their calls so far
        self.cancelled: set[str] = set()  # tags of the submissions this run cancelled

    def take(self, attempts: dict[Any, int], ids: Iterable[Any]) -> None:
        """Take the rows ``ids`` off the batches (out of ``attempts``): they are finished online."""
        for row_id in ids:
            calls = attempts.pop(row_id, None)
            if calls is not None:
                self.rows[row_id] = calls

    def finish(self, todo: pl.DataFrame) -> CheckpointError | None:
        """Send the rows gone online, each as its own request (``online.finish``); ``todo``
        holds their keys."""
        run, rows, self.rows = self.run, self.rows, {}
        calls = pl.DataFrame(
            {run.id: list(rows), ATTEMPTS: list(rows.values())},
            schema={run.id: todo.schema[run.id], ATTEMPTS: pl.Int32},
        )
        keys = todo.drop(ATTEMPTS).join(calls, on=run.id, maintain_order="left")
        job = self.job
        assert job.send is not None
        asking = online.Online(job.request, job.parse, job.send, run.id, job.keep_answers)
        run.log.info("%s: %d row(s) go online.", run.label, keys.height)
        return online.finish(run, asking, keys)

    def past_deadline(self) -> bool:
        way = self.job.way
        if way.mode is Mode.online:
            return True
        if way.mode is not Mode.hybrid or way.deadline_seconds is None:
            return False
        return time.monotonic() - self.run.started >= way.deadline_seconds

    def cancel(self, waiting: list[Submission]) -> bool:
        """Ask the provider to cancel the submissions not cancelled yet; whether any was."""
        run = self.run
        fresh = [s for s in waiting if s.tag not in self.cancelled]
        for s in fresh:
            assert s.batch_id is not None
            self.cancelled.add(s.tag)
            try:
                self.job.provider.cancel(s.batch_id)
            except Exception as e:  # it may have ended meanwhile: it is collected as it is
                run.log.warning("%s: cancelling batch %s: %s", run.label, s.batch_id, e)
        if fresh:
            run.log.info(
                "%s: %s: cancelled %d provider batch(es); their rows without a result go "
                "online once each has ended.",
                run.label,
                "online" if self.job.way.mode is Mode.online else "the deadline passed",
                len(fresh),
            )
        return bool(fresh)
