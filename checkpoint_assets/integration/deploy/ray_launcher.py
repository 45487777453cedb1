"""The run launcher of ``deploy/ray``: dagster-ray's ``RayRunLauncher`` and two checks it lacks.

- **Runs it never launched.** ``dagster asset materialize`` executes a run in its own process:
  there is no Ray job ``dagster-run-<run_id>``. Run monitoring asks the instance's launcher about
  every started run; dagster-ray's gets a 404 from Ray, answers UNKNOWN, and monitoring fails a
  run that is working. Here a run without a launch (no ``RUN_STARTING`` event, which only a
  launcher's run has) is left to its process, as Dagster's default launcher leaves it.
- **Capacity.** A run whose Ray job waits for CPUs stays STARTING. Run monitoring fails it after
  ``start_timeout_seconds`` (using up a retry), although Ray would run it later. Each launch
  compares ``max_concurrent_runs`` with the runs of this size the cluster holds at once. That
  count comes from its nodes' CPUs, refreshed each minute. When the queue can outgrow the
  cluster, the launch says so on the run, with what to change.
- **Code from the environment.** Each entry of ``runtime_env.py_modules`` may be
  ``{env: VAR}``, resolved when the launcher loads; an empty one uploads nothing (the code is
  installed on the nodes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from dagster._config import Array, Field, Noneable, Permissive, StringSource
from dagster._config.config_schema import UserConfigSchema
from dagster._core.events import EngineEventData
from dagster._core.launcher import LaunchRunContext
from dagster._core.launcher.base import CheckRunHealthResult, WorkerStatus
from dagster._core.storage.dagster_run import DagsterRun
from dagster._serdes import ConfigurableClassData
from dagster_ray import RayRunLauncher as _DagsterRayRunLauncher
from dagster_ray.core.run_launcher import RayLauncherConfig

_NODES_TTL_SECONDS = 60.0


class RayRunLauncher(_DagsterRayRunLauncher):
    """dagster-ray's ``RayRunLauncher`` (same configuration) that leaves in-process runs alone
    and warns when ``max_concurrent_runs`` exceeds what the Ray cluster runs at once.
    ``runtime_env.py_modules`` entries also accept ``{env: VAR}``."""

    _node_cpus: list[float] | None = None
    _nodes_read_at = 0.0

    @classmethod
    def config_type(cls) -> UserConfigSchema:
        shape = RayLauncherConfig.to_config_schema().as_field().config_type
        fields: dict[str, Field] = dict(shape.fields)  # type: ignore[attr-defined]
        # Dagster resolves each entry like any other string setting; other keys pass as they are.
        modules = Field(Array(StringSource), is_required=False)
        fields["runtime_env"] = Field(
            Noneable(Permissive({"py_modules": modules})),  # type: ignore[no-untyped-call]
            is_required=False,
            description=fields["runtime_env"].description,
        )
        return {"ray": fields}

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]
    ) -> RayRunLauncher:
        ray = dict(config_value["ray"])
        runtime_env = dict(ray.get("runtime_env") or {})
        if "py_modules" in runtime_env:
            modules = [m for m in runtime_env.pop("py_modules") if m]
            if modules:
                runtime_env["py_modules"] = modules
        ray["runtime_env"] = runtime_env or None
        return cls(inst_data=inst_data, **ray)

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        result: CheckRunHealthResult = super().check_run_worker_health(run)
        if result.status == WorkerStatus.UNKNOWN and not self._was_launched(run):
            return CheckRunHealthResult(
                WorkerStatus.RUNNING, "executes in its own process (not launched as a Ray job)"
            )
        return result

    def _was_launched(self, run: DagsterRun) -> bool:
        return self._instance.get_run_stats(run.run_id).launch_time is not None

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        warning = self._capacity_warning(run)
        if warning:
            self._instance.report_engine_event(
                warning, run, EngineEventData({"advice": _SIZING}), cls=self.__class__
            )
        super().launch_run(context)

    def _capacity_warning(self, run: DagsterRun) -> str | None:
        config = self._instance.get_concurrency_config().run_queue_config
        max_runs = config.max_concurrent_runs if config else -1
        num_cpus = RayLauncherConfig.from_tags(run.tags).num_cpus or self.num_cpus or 0
        node_cpus = self._cluster_cpus()
        if not num_cpus or node_cpus is None:
            return None
        slots = sum(math.floor(cpus / num_cpus + 1e-9) for cpus in node_cpus)
        if 0 <= max_runs <= slots:
            return None
        limit = "no limit" if max_runs < 0 else str(max_runs)
        return (
            f"max_concurrent_runs is {limit}, but the Ray cluster runs at most {slots} at once "
            f"of runs with num_cpus={num_cpus:g} ({sum(node_cpus):g} CPUs on {len(node_cpus)} "
            "nodes): "
            f"runs beyond {slots} wait in Ray's queue as STARTING and run monitoring fails them "
            f"after start_timeout_seconds ({self._instance.run_monitoring_start_timeout_seconds} "
            f"s). Set max_concurrent_runs to {slots} in dagster.yaml (deploy/ray/dagster.yaml "
            "reads it from DAGSTER_MAX_CONCURRENT_RUNS)."
        )

    def _cluster_cpus(self) -> list[float] | None:
        """CPUs of each alive node (None when the cluster cannot say), read once a minute."""
        now = time.monotonic()
        if self._node_cpus is None or now - self._nodes_read_at > _NODES_TTL_SECONDS:
            self._node_cpus, self._nodes_read_at = _read_node_cpus(self.address), now
        return self._node_cpus


def _read_node_cpus(address: str) -> list[float] | None:
    from ray.util.state import list_nodes

    try:
        nodes = list_nodes(address=address, filters=[("state", "=", "ALIVE")], detail=True)
    except Exception:  # an old or unreachable dashboard: the launch itself will say more
        return None
    return [float((n.resources_total or {}).get("CPU", 0)) for n in nodes]


_SIZING = (
    "Ray reserves a run's num_cpus on one node until the run ends, so the cluster runs "
    "sum over nodes of floor(node CPUs / num_cpus) runs at once; queue the rest in Dagster."
)
