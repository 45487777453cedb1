"""Which partitions of a checkpointed asset are failed, as ``failed_partitions_sensor`` sees them.

- ``failures()``: which partitions are failed now, and by which run. A partition is failed when:
    - Dagster's partition status says FAILED (the latest attempt failed);
    - a failed run that planned its partitions as one subset event covers the partition, and
      nothing materialized it since. Such a run is a backfill with a ``backfill_policy``, where
      the instance emits one planned event per run. The partition status does not follow those
      events. The run covers the partition with ``dagster/asset_partition_range_start``/``_end``
      tags (or ``dagster/partition``). Such runs are found among the asset's own planned
      materializations, followed with a cursor. They are never looked for among the instance's
      recent runs, where other jobs' failures would push them out of view;
    - while the asset's ``retry_failed`` is on: its latest materialization reports
      ``rows_failed > 0`` (tolerated by ``max_failed_fraction``).
- ``stopped_by_budget()``: failures whose run the spend budget stopped (the sensor leaves them).

Runs that Dagster's own run retries will re-execute are not failures here. Nor are runs that
submitted provider batches and ended. Dagster declines to retry runs made in process, and runs of
a backfill that has ended. So the failed runs of ``dagster asset materialize`` are failures here.
So are those of ``dagster job backfill``, whose backfill ends as it submits them. ``SensorState``
is what the sensor remembers between ticks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

# The statuses in which the run retry daemon declines a backfill's runs: its own rule.
from dagster._core.execution.backfill import BULK_ACTION_TERMINAL_STATUSES

from checkpoint_assets.engine.checkpoints.layout import UNPARTITIONED
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.watch.events import records_after
from checkpoint_assets.integration.watch.pending import PENDING_TAG
from checkpoint_assets.integration.watch.spend import STOPPED_BY_TAG

PARTITION_TAG = "dagster/partition"
BACKFILL_TAG = "dagster/backfill"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
_PAGE = 1000
_RUNS_PER_QUERY = 100
_CURSOR_VERSION = 3


@dataclass(frozen=True)
class Failure:
    """The latest failure of one partition: the run that failed, when, and why it counts."""

    run_id: str
    at: float
    why: str


@dataclass
class Budget:
    """Retries spent on one partition since it last succeeded."""

    attempts: int = 0
    retried_run: str | None = None  # the failed run the last retry was requested for
    gave_up: bool = False


@dataclass
class SensorState:
    """What the sensor remembers between ticks (its JSON cursor)."""

    after: int = 0  # last materialization event read (storage id)
    partial: dict[str, Failure] = field(default_factory=dict)  # latest had rows_failed > 0
    budgets: dict[str, Budget] = field(default_factory=dict)
    planned_after: int = 0  # last planned materialization read (storage id)
    ranged: set[str] = field(default_factory=set)  # ranged runs not yet succeeded or made good

    def to_json(self) -> str:
        return json.dumps(
            {
                "v": _CURSOR_VERSION,
                "after": self.after,
                "partial": {k: [f.run_id, f.at] for k, f in sorted(self.partial.items())},
                "budgets": {
                    k: [b.attempts, b.retried_run, b.gave_up]
                    for k, b in sorted(self.budgets.items())
                },
                "planned_after": self.planned_after,
                "ranged": sorted(self.ranged),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | None) -> SensorState:
        if not text:
            return cls()
        data = json.loads(text)
        if data.get("v") not in (2, _CURSOR_VERSION):  # 2: before planned events were followed
            return cls()
        return cls(
            after=int(data["after"]),
            partial={
                k: Failure(str(run), float(at), "rows failed")
                for k, (run, at) in data["partial"].items()
            },
            budgets={
                k: Budget(int(n), run, bool(gave)) for k, (n, run, gave) in data["budgets"].items()
            },
            planned_after=int(data.get("planned_after", 0)),
            ranged=set(data.get("ranged", ())),
        )


# -- which partitions are failed ---------------------------------------------------------------
def statuses(
    instance: dg.DagsterInstance, key: dg.AssetKey, partitions_def: dg.PartitionsDefinition | None
) -> dict[str, dg.AssetPartitionStatus | None]:
    if partitions_def is None:
        return {UNPARTITIONED: _unpartitioned_status(instance, key)}
    keys = partitions_def.get_partition_keys(dynamic_partitions_store=instance)
    return dict(instance.get_status_by_partition(key, keys, partitions_def) or {})


def _unpartitioned_status(
    instance: dg.DagsterInstance, key: dg.AssetKey
) -> dg.AssetPartitionStatus | None:
    planned = instance.get_latest_planned_materialization_info(key)
    if planned is None:
        return None
    latest = instance.get_latest_materialization_event(key)
    run = instance.get_run_by_id(planned.run_id)
    if run is None:
        return None
    if not run.is_finished:
        return dg.AssetPartitionStatus.IN_PROGRESS
    if latest is not None and latest.run_id == planned.run_id:
        return dg.AssetPartitionStatus.MATERIALIZED
    if run.status == dg.DagsterRunStatus.FAILURE:
        return dg.AssetPartitionStatus.FAILED
    return None


def read_materializations(
    instance: dg.DagsterInstance, key: dg.AssetKey, state: SensorState
) -> None:
    """Follow new materializations: remember partitions whose latest one had failed rows."""
    for record in records_after(instance.fetch_materializations, key, state.after):
        materialization = record.asset_materialization
        state.after = max(state.after, record.storage_id)
        if materialization is None:
            continue
        partition = materialization.partition or UNPARTITIONED
        failed = materialization.metadata.get(md.ROWS_FAILED)
        if failed is not None and _count(failed) > 0:
            state.partial[partition] = Failure(record.run_id, record.timestamp, "rows failed")
        else:
            state.partial.pop(partition, None)


def failures(
    instance: dg.DagsterInstance,
    key: dg.AssetKey,
    partitions_def: dg.PartitionsDefinition | None,
    statuses: Mapping[str, dg.AssetPartitionStatus | None],
    state: SensorState,
) -> dict[str, Failure]:
    """The latest failure of every failed partition (none for partitions in progress)."""
    found: dict[str, Failure] = {}

    def add(partition: str, failure: Failure) -> None:
        if statuses.get(partition) == dg.AssetPartitionStatus.IN_PROGRESS:
            return
        if partition not in found or failure.at > found[partition].at:
            found[partition] = failure

    for partition, failure in state.partial.items():
        if statuses.get(partition) == dg.AssetPartitionStatus.MATERIALIZED:
            add(partition, failure)
    failed = [p for p, s in statuses.items() if s == dg.AssetPartitionStatus.FAILED]
    for partition, failure in _failed_runs_of(instance, key, failed).items():
        add(partition, failure)
    if partitions_def is not None:
        _read_ranged_runs(instance, key, state)
        for partition, failure in _failed_range_runs(instance, key, partitions_def, state).items():
            add(partition, failure)
    return found


def _failed_runs_of(
    instance: dg.DagsterInstance, key: dg.AssetKey, partitions: Sequence[str]
) -> dict[str, Failure]:
    """The failed run behind each FAILED partition: its latest planned materialization's run.

    It takes one query whatever the number of partitions, plus one per 100 failed runs. The run
    of each partition's latest attempt without a materialization comes from one query. Dagster's
    own partition status is computed with that query, and every event log storage implements it.

    A run that Dagster's own run retries will re-execute is left to them. Such a run is tagged
    ``dagster/will_retry``, its retry not yet launched. Retrying it here too would run the shard
    twice. A run that
    submitted provider batches and ended (``pending.PENDING_TAG``) did not fail: its partition
    is ``provider_batches_sensor``'s.
    """
    runs: dict[str, str] = {}
    if UNPARTITIONED in partitions:
        planned = instance.get_latest_planned_materialization_info(key)
        if planned is not None:
            runs[UNPARTITIONED] = planned.run_id
    wanted = set(partitions) - {UNPARTITIONED}
    if wanted:
        storage = instance.event_log_storage
        attempts = (
            storage.get_latest_asset_partition_materialization_attempts_without_materializations(
                key
            )
        )
        runs.update({p: run for p, (run, _) in attempts.items() if p in wanted})
    ended = _ended(instance, set(runs.values()))
    return {
        p: Failure(run, ended[run][0] if run in ended else time.time(), "run failed")
        for p, run in runs.items()
        if not (run in ended and ended[run][1])
    }


def _ended(instance: dg.DagsterInstance, run_ids: Iterable[str]) -> dict[str, tuple[float, bool]]:
    """When each run ended, and whether it is not this sensor's to retry: Dagster's run retries
    will re-execute it, or it submitted provider batches and ended."""
    ids = sorted(run_ids)
    out: dict[str, tuple[float, bool]] = {}
    for start in range(0, len(ids), 100):
        for record in instance.get_run_records(dg.RunsFilter(run_ids=ids[start : start + 100])):
            run = record.dagster_run
            ended = record.end_time or record.update_timestamp.timestamp()
            out[run.run_id] = (ended, _not_ours(instance, run))
    return out


def _read_ranged_runs(instance: dg.DagsterInstance, key: dg.AssetKey, state: SensorState) -> None:
    """Follow new planned materializations of the asset.

    A run may plan a range of its partitions in one event, with no partition of its own. Such a
    run is watched until it succeeds, or until every partition it covered has materialized since.
    """
    storage = instance.event_log_storage  # the instance's own reader of these is deprecated
    while True:
        records = storage.get_event_records(
            dg.EventRecordsFilter(
                dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED,
                asset_key=key,
                after_cursor=state.planned_after or None,
            ),
            limit=_PAGE,
            ascending=True,
        )
        for record in records:
            state.planned_after = max(state.planned_after, record.storage_id)
            if record.partition_key is None:
                state.ranged.add(record.run_id)
        if len(records) < _PAGE:
            return


def _failed_range_runs(
    instance: dg.DagsterInstance,
    key: dg.AssetKey,
    partitions_def: dg.PartitionsDefinition,
    state: SensorState,
) -> dict[str, Failure]:
    """Partitions covered by the watched ranged runs that failed, not materialized since each
    run began (a shard that finished in it materialized then).

    Ranged runs carry the first and last partition of their range in the tags
    ``dagster/asset_partition_range_start``/``_end`` instead of ``dagster/partition``. One query
    per 100 watched runs; a run that succeeded, was deleted or has been made good is dropped.
    """
    watched = sorted(state.ranged)
    if not watched:
        return {}
    records: dict[str, dg.RunRecord] = {}
    for start in range(0, len(watched), _RUNS_PER_QUERY):
        chunk = dg.RunsFilter(run_ids=watched[start : start + _RUNS_PER_QUERY])
        records.update((r.dagster_run.run_id, r) for r in instance.get_run_records(chunk))
    keys = partitions_def.get_partition_keys(dynamic_partitions_store=instance)
    position = {k: i for i, k in enumerate(keys)}
    ranged: list[tuple[Failure, list[str], float]] = []
    for run_id in watched:
        record = records.get(run_id)
        if record is None:
            state.ranged.discard(run_id)  # deleted
            continue
        run = record.dagster_run
        if not run.is_finished or _not_ours(instance, run):
            continue  # in progress, Dagster's run retries will re-execute it, or batches wait
        # One partition planned as a subset of one carries only ``dagster/partition``.
        one = run.tags.get(PARTITION_TAG, "")
        first, last = run.tags.get(RANGE_START_TAG, one), run.tags.get(RANGE_END_TAG, one)
        if run.status != dg.DagsterRunStatus.FAILURE or not {first, last} <= position.keys():
            state.ranged.discard(run_id)  # succeeded, or its range no longer exists
            continue
        covered = list(keys[position[first] : position[last] + 1])
        ended = record.end_time or record.update_timestamp.timestamp()
        # A shard that finished in the run itself materialized as it ended: not failed.
        began = record.start_time or record.create_timestamp.timestamp()
        ranged.append((Failure(run_id, ended, "backfill run failed"), covered, began))
    if not ranged:
        return {}
    materialized_at = _latest_materializations(
        instance, key, {p for _, covered, _ in ranged for p in covered}
    )
    out: dict[str, Failure] = {}
    for failure, covered, began in ranged:
        pending = [p for p in covered if materialized_at.get(p, 0.0) < began]
        if not pending:
            state.ranged.discard(failure.run_id)  # every partition it covered succeeded since
        for partition in pending:
            if partition not in out or failure.at > out[partition].at:
                out[partition] = failure
    return out


def _latest_materializations(
    instance: dg.DagsterInstance, key: dg.AssetKey, partitions: set[str]
) -> dict[str, float]:
    """When each of ``partitions`` last materialized (only those read, not every partition)."""
    latest = instance.get_latest_storage_id_by_partition(
        key, dg.DagsterEventType.ASSET_MATERIALIZATION
    )
    by_id = {i: p for p, i in latest.items() if p in partitions}
    ids = sorted(by_id)
    out: dict[str, float] = {}
    for start in range(0, len(ids), _PAGE):
        chunk = ids[start : start + _PAGE]
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=key, storage_ids=chunk), limit=len(chunk)
        ).records
        out.update({by_id[r.storage_id]: r.timestamp for r in records})
    return out


def stopped_by_budget(instance: dg.DagsterInstance, failures: Mapping[str, Failure]) -> set[str]:
    """The failed partitions whose failed run its spend budget stopped (a run tag)."""
    ids = sorted({f.run_id for f in failures.values()})
    stopped: set[str] = set()
    for start in range(0, len(ids), _RUNS_PER_QUERY):
        chunk = dg.RunsFilter(
            run_ids=ids[start : start + _RUNS_PER_QUERY], tags={STOPPED_BY_TAG: "budget"}
        )
        stopped.update(r.dagster_run.run_id for r in instance.get_run_records(chunk))
    return {p for p, f in failures.items() if f.run_id in stopped}


def _not_ours(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    """Dagster's run retries will re-execute ``run``, or it submitted provider batches and
    ended (``provider_batches_sensor`` requests the run that collects them)."""
    return PENDING_TAG in run.tags or _dagster_retries(instance, run)


def _dagster_retries(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    """Whether Dagster's run retries will re-execute ``run``.

    A failed run is tagged ``dagster/will_retry`` when the instance's run retries allow it. The
    daemon (``dagster/_daemon/auto_run_reexecution``) still declines it in two cases:

    - it was run in process, with no code location to launch it from again
      (``dagster asset materialize``);
    - it belongs to a backfill that has ended or is gone.

    ``dagster job backfill`` marks its backfill COMPLETED as it submits the runs. So Dagster
    never retries them: they are ours.
    """
    if not run.is_complete_and_waiting_to_retry or run.remote_job_origin is None:
        return False
    backfill_id = run.tags.get(BACKFILL_TAG)
    if backfill_id is None:
        return True
    backfill = instance.get_backfill(backfill_id)
    return backfill is not None and backfill.status not in BULK_ACTION_TERMINAL_STATUSES


def _count(value: Any) -> float:
    raw = md.plain(value)
    try:
        return float(raw)
    except (TypeError, ValueError):
        return 0.0
