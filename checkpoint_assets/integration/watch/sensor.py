"""``failed_partitions_sensor``: retry failed partitions of an asset, with backoff.

Each tick, in order:

1. ``failures()``: which partitions are failed now, and by which run (``failures.py``).
2. ``stopped_by_budget()``: failures whose run the spend budget stopped are left alone.
3. ``_decide()``, per partition, against its retries left in the cursor. It requests a retry once
   the backoff since the failure has passed, waits, or gives up. A partition that succeeded
   since gets its budget back.

A failure is identified by the run that failed, so a tick that runs before the requested retry has
started does not count it twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import dagster as dg

from checkpoint_assets.engine.checkpoints.layout import UNPARTITIONED
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.watch import failures as finding
from checkpoint_assets.integration.watch.failures import Budget, Failure, SensorState

RETRY_OF_TAG = "checkpoint_assets/retry_of"
RETRY_ATTEMPT_TAG = "checkpoint_assets/retry_attempt"

__all__ = [
    "RETRY_ATTEMPT_TAG",
    "RETRY_OF_TAG",
    "SensorState",
    "failed_partitions_sensor",
    "retry_due",
]


def retry_due(failed_at: float, attempts: int, backoff_seconds: float) -> float:
    """When a partition that failed at ``failed_at`` may get its retry number ``attempts + 1``.

    The wait doubles with each retry: ``backoff_seconds``, then twice that, then four times.

    >>> retry_due(100.0, 0, 60.0), retry_due(100.0, 2, 60.0), retry_due(100.0, 5, 0.0)
    (160.0, 340.0, 100.0)
    """
    return failed_at + backoff_seconds * 2.0**attempts


def failed_partitions_sensor(
    asset: dg.AssetsDefinition,
    max_retries: int = 3,
    backoff_seconds: float = 60.0,
    minimum_interval_seconds: int = 30,
    name: str | None = None,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """A sensor that requests a run for each failed partition of ``asset``, up to ``max_retries``.

    A partition counts as failed in two cases:

    - its latest run failed. Ranged backfill runs count too: they carry partition-range tags
      instead of ``dagster/partition``.
    - while the asset's ``retry_failed`` is on, it materialized with ``rows_failed > 0``. The
      failed rows then get computed again.

    Retry ``n`` is requested at least ``backoff_seconds * 2**(n-1)`` after the failure
    (``backoff_seconds=0``: at the next tick). When the asset's ``backfill_policy`` runs several
    partitions per run, neighbouring partitions that failed in the same run are retried in one
    ranged run (up to the policy's partitions per run); partitions that did not fail are never
    in it.

    A partition whose spend budget stopped its run is not retried, since it would stop again.
    Such a run raised :class:`BudgetExceededError` and is tagged ``checkpoint_assets/stopped_by``.
    The skip reason names the partition until a person raises the limit and materializes it.

    Each partition gets ``max_retries`` retries, counted in the sensor's cursor; a partition that
    succeeds gets them back. When a partition has no retries left, the sensor stops asking for
    it and names it in its skip reason and log. Fix the cause, then materialize it by hand (or
    reset the sensor's cursor).

    Example::

        defs = dg.Definitions(
            assets=[tickets, ticket_routing],
            sensors=[failed_partitions_sensor(ticket_routing, max_retries=3)],
            resources={"io_manager": CheckpointIOManager(base_dir="s3://bucket/checkpoints")},
        )
    """
    if max_retries < 0:
        raise ValueError(f"max_retries must be 0 or more, got {max_retries}")
    if backoff_seconds < 0:
        raise ValueError(f"backoff_seconds must be 0 or more, got {backoff_seconds}")
    key = asset.key
    partitions_def = asset.partitions_def
    retry_failed = bool(md.plain(asset.metadata_by_key.get(key, {}).get(md.RETRY_FAILED)))
    label = key.to_user_string()

    @dg.sensor(
        name=name or f"{key.to_python_identifier()}_failed_partitions",
        target=asset,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=(
            f"Retries failed partitions of {label}: up to {max_retries} times each, waiting "
            f"{backoff_seconds:g} s after a failure, doubling per retry."
        ),
    )
    def sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        state = SensorState.from_json(context.cursor)
        instance = context.instance
        statuses = finding.statuses(instance, key, partitions_def)
        if retry_failed:
            finding.read_materializations(instance, key, state)
        else:
            state.partial.clear()
        failures = finding.failures(instance, key, partitions_def, statuses, state)
        busy = {p for p, s in statuses.items() if s == dg.AssetPartitionStatus.IN_PROGRESS}
        # A shard its spend budget stopped would stop again: a person raises the limit.
        held = finding.stopped_by_budget(instance, failures)
        failures = {p: f for p, f in failures.items() if p not in held}
        now = time.time()
        decision = _decide(state, failures, busy | set(held), now, max_retries, backoff_seconds)
        decision.held = sorted(held)
        _log(context.log, label, decision, failures, max_retries)
        requests = _run_requests(decision, Ranges.of(asset, instance))
        if requests:
            return dg.SensorResult(run_requests=requests, cursor=state.to_json())
        return dg.SensorResult(
            skip_reason=_skip_reason(label, decision, max_retries, now), cursor=state.to_json()
        )

    return sensor


def _log(
    log: logging.Logger,
    label: str,
    decision: Decision,
    failures: dict[str, Failure],
    max_retries: int,
) -> None:
    """Say in the sensor's log which partitions got their retries back, gave up, or are retried."""
    for partition in decision.reset:
        log.info(f"{label} {_show(partition)} succeeded: its retries are counted from zero again.")
    for partition in decision.newly_gave_up:
        log.warning(
            f"{label} {_show(partition)} failed again after {max_retries} retries (last "
            f"failed run {failures[partition].run_id}); giving up on it. Fix the cause and "
            "materialize it by hand: a success gives it its retries back."
        )
    for partition, failure, attempt in decision.requests:
        log.info(
            f"Retrying {label} {_show(partition)} ({failure.why} in run {failure.run_id}), "
            f"retry {attempt} of {max_retries}."
        )


def _run_requests(decision: Decision, ranges: Ranges | None) -> list[dg.RunRequest]:
    """The runs that retry the partitions of ``decision``, keyed so that a failed run is
    retried once: one run per partition, or with ``ranges`` (the asset's backfill policy runs
    several partitions per run), one ranged run per stretch of neighbouring partitions that
    failed in the same run, up to the policy's partitions per run. A ranged run covers exactly
    its partitions: partitions that did not fail between them split it."""
    if ranges is None:
        return [
            dg.RunRequest(
                partition_key=None if partition == UNPARTITIONED else partition,
                run_key=f"{partition}:{failure.run_id}",
                tags={RETRY_OF_TAG: failure.run_id, RETRY_ATTEMPT_TAG: str(attempt)},
            )
            for partition, failure, attempt in decision.requests
        ]
    groups: dict[tuple[str, int], list[str]] = {}
    for partition, failure, attempt in decision.requests:
        groups.setdefault((failure.run_id, attempt), []).append(partition)
    requests = []
    for (run_id, attempt), partitions in sorted(groups.items()):
        for first, last in ranges.stretches(partitions):
            tags = {RETRY_OF_TAG: run_id, RETRY_ATTEMPT_TAG: str(attempt)}
            if first == last:
                requests.append(
                    dg.RunRequest(partition_key=first, run_key=f"{first}:{run_id}", tags=tags)
                )
                continue
            tags[finding.RANGE_START_TAG], tags[finding.RANGE_END_TAG] = first, last
            requests.append(dg.RunRequest(run_key=f"{first}...{last}:{run_id}", tags=tags))
    return requests


@dataclass(frozen=True)
class Ranges:
    """How the asset's backfill policy groups partitions into runs: its partition keys in
    order, and at most ``per_run`` of them per run (None: any number)."""

    keys: list[str]
    per_run: int | None

    @classmethod
    def of(cls, asset: dg.AssetsDefinition, instance: dg.DagsterInstance) -> Ranges | None:
        """None when the asset runs one partition per run (no policy, or one per run)."""
        policy, partitions_def = asset.backfill_policy, asset.partitions_def
        if policy is None or partitions_def is None or policy.max_partitions_per_run == 1:
            return None
        keys = partitions_def.get_partition_keys(dynamic_partitions_store=instance)
        return cls(list(keys), policy.max_partitions_per_run)

    def stretches(self, partitions: list[str]) -> list[tuple[str, str]]:
        """``partitions`` as (first, last) of each stretch of neighbours, ``per_run`` at most."""
        position = {k: i for i, k in enumerate(self.keys)}
        runs: list[list[int]] = []
        for index in sorted(position[p] for p in partitions if p in position):
            last = runs[-1] if runs else None
            if (
                last
                and index == last[-1] + 1
                and (self.per_run is None or len(last) < self.per_run)
            ):
                last.append(index)
            else:
                runs.append([index])
        return [(self.keys[r[0]], self.keys[r[-1]]) for r in runs]


# -- what to do about them ---------------------------------------------------------------------
@dataclass
class Decision:
    """One tick's outcome."""

    requests: list[tuple[str, Failure, int]] = field(default_factory=list)
    waiting: dict[str, float] = field(default_factory=dict)  # partition -> retry due at
    gave_up: list[str] = field(default_factory=list)
    newly_gave_up: list[str] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)  # stopped by their spend budget


def _decide(
    state: SensorState,
    failures: Mapping[str, Failure],
    busy: set[str],
    now: float,
    max_retries: int,
    backoff_seconds: float,
) -> Decision:
    decision = Decision()
    for partition in list(state.budgets):
        if partition not in failures and partition not in busy:
            del state.budgets[partition]  # it succeeded (or was wiped): a fresh budget
            decision.reset.append(partition)
    for partition, failure in sorted(failures.items()):
        budget = state.budgets.setdefault(partition, Budget())
        if budget.retried_run == failure.run_id:
            continue  # the retry of this failure is requested and has not started yet
        if budget.attempts >= max_retries:
            decision.gave_up.append(partition)
            if not budget.gave_up:
                budget.gave_up = True
                decision.newly_gave_up.append(partition)
            continue
        due = retry_due(failure.at, budget.attempts, backoff_seconds)
        if now < due:
            decision.waiting[partition] = due
            continue
        budget.attempts += 1
        budget.retried_run = failure.run_id
        decision.requests.append((partition, failure, budget.attempts))
    return decision


def _skip_reason(label: str, decision: Decision, max_retries: int, now: float) -> str:
    parts: list[str] = []
    if decision.gave_up:
        parts.append(
            f"Gave up on {len(decision.gave_up)} partition(s) of {label} after {max_retries} "
            f"retries each: {', '.join(_show(p) for p in decision.gave_up)}. Fix the cause and "
            "materialize them by hand; a success resets their budget."
        )
    if decision.held:
        parts.append(
            f"{len(decision.held)} partition(s) of {label} stopped at their spend budget are not "
            f"retried: {', '.join(_show(p) for p in decision.held)}. Raise the limit in run "
            "config (budget: {max_run_cost / max_asset_cost}) and materialize them."
        )
    if decision.waiting:
        soonest = min(decision.waiting.values())
        parts.append(
            f"{len(decision.waiting)} failed partition(s) of {label} wait for their backoff; "
            f"the next retry is due in {max(soonest - now, 0):.0f} s."
        )
    return " ".join(parts) or f"No failed partitions of {label} to retry."


def _show(partition: str) -> str:
    return "(unpartitioned)" if partition == UNPARTITIONED else partition
