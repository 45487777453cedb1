"""A step that outlives its run stops itself: the ``RunWatch`` its checkpoint lease asks.

A step process can outlive its run. The run worker or ``dagster asset materialize`` that started
it may have been killed. Or run monitoring marked the run failed while the step went on. The
lease's heartbeat asks ``stop_reason`` every few seconds (``engine/loop/lock.py``). The step
stops when its run is over (failed, canceled, succeeded) or when the process that launched it
through ``multiprocessing`` is gone. It then starts no more calls, stores what is done, releases
the lock and fails with ``RunStoppedError``. With its launcher gone, nothing else would end its
run, so the step reports the run failed itself (``report_orphaned``).

A run may take over the lock of a holder that died on this host. When the holder's launcher is
gone too, the run reports the holder's run failed, with why. Otherwise that run would show
STARTED for ever. A holder whose launcher lives is left to it: the run worker fails the step and
the run.
"""

from __future__ import annotations

import multiprocessing

import dagster as dg

from checkpoint_assets.engine.loop.lock import Holder, pid_alive

_OVER = {
    dg.DagsterRunStatus.FAILURE: "failed",
    dg.DagsterRunStatus.CANCELED: "canceled",
    dg.DagsterRunStatus.CANCELING: "being canceled",
    dg.DagsterRunStatus.SUCCESS: "succeeded",
}


class DagsterRunWatch:
    """What the lease of a step of run ``run_id`` asks the instance (see ``lock.RunWatch``)."""

    def __init__(self, instance: dg.DagsterInstance, run_id: str, step: str) -> None:
        self.instance = instance
        self.run_id = run_id
        self.step = step  # for messages: the asset and partition
        self.launcher = multiprocessing.parent_process()  # None: the step runs in its launcher

    def launcher_gone(self) -> str | None:
        """Why this step has no launcher any more, or None while it has one (or needs none)."""
        if self.launcher is None or self.launcher.is_alive():
            return None
        return f"the process that launched this step (pid {self.launcher.pid}) is gone"

    def stop_reason(self) -> str | None:
        gone = self.launcher_gone()
        if gone is not None:
            return gone
        over = self.run_over(self.run_id)
        return None if over is None else f"its run {self.run_id} is {over}"

    def run_over(self, run_id: str) -> str | None:
        record = self.instance.get_run_by_id(run_id)
        return None if record is None else _OVER.get(record.status)

    def holder_died(self, holder: Holder, reason: str) -> None:
        if holder.run_id in (None, self.run_id):
            return  # a step retried within this run: the run goes on
        if not holder.local or pid_alive(holder.pid):
            return  # only a death seen on this host is sure
        if holder.launcher is not None and pid_alive(holder.launcher):
            return  # its run worker ends the run
        self._fail(
            holder.run_id,
            f"Its step {self.step} (pid {holder.pid} on {holder.host}) died holding the "
            f"checkpoint lock ({reason}), and nothing else ends this run. Run {self.run_id} took "
            "the lock over and resumes from what was stored.",
        )

    def report_orphaned(self) -> None:
        """Report this run failed when this step stopped because its launcher is gone."""
        gone = self.launcher_gone()
        if gone is not None:
            self._fail(
                self.run_id,
                f"Step {self.step} stopped by itself: {gone}. It stored the rows it computed "
                "and released the checkpoint lock. Materialize the partition again: it resumes.",
            )

    def _fail(self, run_id: str, message: str) -> None:
        run = self.instance.get_run_by_id(run_id)
        if run is not None and not run.is_finished:
            self.instance.report_run_failed(run, message)
