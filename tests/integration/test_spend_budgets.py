"""Spend budgets through real Dagster runs on a real (SQLite) instance: every materialization
records its cost and the asset's total read from the instance, a run budget and an asset budget
stop new calls with everything done checkpointed, run config raises a limit to go on, and
failed_partitions_sensor leaves a shard its budget stopped alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import (
    ASSET,
    Job,
    build_job,
    ids_in_shard,
    poisoned,
    route,
    run_logs,
    step_error,
    tickets,
)

from checkpoint_assets import (
    Budget,
    BudgetExceededError,
    Price,
    failed_partitions_sensor,
    shard_partitions,
)
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.watch import spend

# 1,000 input and 500 output tokens a row at 1 and 2 USD per million: 0.002 USD a row; the
# job's calls take 4 rows (checkpoint_interval 4): 0.008 USD a call.
ROW_USD = 0.002
SHARDS = shard_partitions(2)


def priced(batch: pl.DataFrame, fn: Any = route) -> pl.DataFrame:
    return fn(batch).with_columns(input_tokens=pl.lit(1000), output_tokens=pl.lit(500))


def _job(
    tmp_path: Path, df: pl.DataFrame, fn: Any = priced, policy: Any = None, **budget: Any
) -> Job:
    return build_job(
        (str(tmp_path / "checkpoints"), {}),
        df,
        fn=fn,
        instance=dg.DagsterInstance.local_temp(
            tempdir=str(tmp_path), overrides={"telemetry": {"enabled": False}}
        ),
        usage_columns=["input_tokens", "output_tokens"],
        budget=Budget({"small": Price(input=1.0, output=2.0)}, **budget),
        partitions_def=SHARDS,
        backfill_policy=policy,
    )


def _cost(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    (event,) = result.asset_materializations_for_node(ASSET)
    keys = (md.COST_USD, md.COST_SHARD_TOTAL_USD, md.COST_ASSET_TOTAL_USD, md.COST_BY_MODEL)
    return {k: event.metadata[k].value for k in keys}


def _observed(job: Job, result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    """The cost observation the failed run recorded."""
    records = job.instance.fetch_observations(dg.AssetKey(ASSET), limit=10).records
    (event,) = [
        r.asset_observation
        for r in records
        if r.run_id == result.run_id
        and r.asset_observation
        and md.COST_USD in r.asset_observation.metadata
    ]
    return {k: md.plain(v) for k, v in event.metadata.items()}


def test_every_materialization_records_its_cost_and_the_assets_total(tmp_path: Path) -> None:
    df = tickets(40)
    rows = [len(ids_in_shard(df, s, 2)) for s in range(2)]
    job = _job(tmp_path, df)
    first = _cost(job.materialize("0-of-2"))
    assert first == {
        md.COST_USD: pytest.approx(rows[0] * ROW_USD),
        md.COST_SHARD_TOTAL_USD: pytest.approx(rows[0] * ROW_USD),
        md.COST_ASSET_TOTAL_USD: pytest.approx(rows[0] * ROW_USD),
        md.COST_BY_MODEL: {"small": pytest.approx(rows[0] * ROW_USD)},
    }
    # The other shard's run reads the first one's total from the instance.
    second = _cost(job.materialize("1-of-2"))
    assert second[md.COST_USD] == pytest.approx(rows[1] * ROW_USD)
    assert second[md.COST_ASSET_TOTAL_USD] == pytest.approx(40 * ROW_USD)
    # A run that resumes everything pays nothing; the totals stay.
    again = _cost(job.materialize("0-of-2"))
    assert again[md.COST_USD] == 0 and again[md.COST_BY_MODEL] == {}
    assert again[md.COST_SHARD_TOTAL_USD] == pytest.approx(rows[0] * ROW_USD)
    assert again[md.COST_ASSET_TOTAL_USD] == pytest.approx(40 * ROW_USD)


def test_a_ranged_run_records_each_shards_own_cost(tmp_path: Path) -> None:
    df = tickets(40)
    rows = [len(ids_in_shard(df, s, 2)) for s in range(2)]
    job = _job(tmp_path, df, policy=dg.BackfillPolicy.single_run())
    ranged = dg.materialize(
        [job.source, job.asset],
        instance=job.instance,
        resources=job.resources(),
        tags={
            "dagster/asset_partition_range_start": "0-of-2",
            "dagster/asset_partition_range_end": "1-of-2",
        },
    )
    events = ranged.asset_materializations_for_node(ASSET)
    costs = {e.partition: e.metadata[md.COST_USD].value for e in events}
    assert costs == {f"{s}-of-2": pytest.approx(rows[s] * ROW_USD) for s in range(2)}
    # Each shard materializes as it ends: the asset's total as of then.
    totals = [e.metadata[md.COST_ASSET_TOTAL_USD].value for e in events]
    assert totals == [pytest.approx(rows[0] * ROW_USD), pytest.approx(40 * ROW_USD)]


def test_a_run_budget_stops_the_run_midway_and_run_config_raises_it(tmp_path: Path) -> None:
    df = tickets(80)
    shard = ids_in_shard(df, 0, 2)
    job = _job(tmp_path, df, max_run_cost=0.02)
    stopped = job.materialize("0-of-2", raise_on_error=False)
    assert not stopped.success
    # 0.02 USD is reached by the third call of 4 rows (0.024): no call starts after it.
    assert len(job.calls) == 3
    assert job.checkpoint("0-of-2").load("ticket_id").rows.height == 12
    error = step_error(stopped)
    assert error.startswith("BudgetExceededError") and "stopped at the spend limit" in error
    assert "max_run_cost is 0.0200 USD" in error and "has spent 0.0240 USD" in error
    assert "budget: {max_run_cost: <USD>}" in error and "resumes" in error
    # What the stopped run spent is recorded though the shard did not materialize.
    observed = _observed(job, stopped)
    assert observed[md.COST_USD] == pytest.approx(0.024)
    assert observed["stopped_by"] == BudgetExceededError.__name__
    assert any("12 rows are checkpointed" in line for line in run_logs(stopped, job.instance))

    # Raising the limit in run config goes on from the checkpoint: only the rest is paid for.
    done = job.materialize("0-of-2", budget={"max_run_cost": 1.0})
    first, second = ([i for c in calls for i in c] for calls in (job.calls[:3], job.calls[3:]))
    assert sorted(first + second) == sorted(shard)  # no row paid for twice
    cost = _cost(done)
    assert cost[md.COST_USD] == pytest.approx((len(shard) - 12) * ROW_USD)
    assert cost[md.COST_SHARD_TOTAL_USD] == pytest.approx(len(shard) * ROW_USD)


def test_an_asset_budget_spans_shards_and_the_sensor_leaves_the_stopped_shard(
    tmp_path: Path,
) -> None:
    df = tickets(80)
    rows = [len(ids_in_shard(df, s, 2)) for s in range(2)]
    limit = rows[0] * ROW_USD + 0.01  # shard 0 whole, then 0.01 USD: two calls of shard 1
    job = _job(tmp_path, df, max_asset_cost=limit)
    assert job.materialize("0-of-2").success
    stopped = job.materialize("1-of-2", raise_on_error=False)
    assert not stopped.success
    assert job.checkpoint("1-of-2").load("ticket_id").rows.height == 8
    error = step_error(stopped)
    assert f"max_asset_cost is {limit:.4f} USD" in error
    assert f"has spent {rows[0] * ROW_USD + 0.016:.4f} USD" in error
    assert _observed(job, stopped)[md.COST_ASSET_TOTAL_USD] == pytest.approx(
        rows[0] * ROW_USD + 0.016
    )

    # The sensor does not retry it: it would stop again.
    sensor = failed_partitions_sensor(job.asset, backoff_seconds=0)
    defs = dg.Definitions(
        assets=[job.source, job.asset], sensors=[sensor], resources=job.resources()
    )
    tick = sensor.evaluate_tick(dg.build_sensor_context(instance=job.instance, definitions=defs))
    assert list(tick.run_requests or []) == []
    assert "stopped at their spend budget are not retried: 1-of-2" in (tick.skip_message or "")

    # Raised in run config, the shard finishes; the asset's total counts the stopped run's spend.
    done = job.materialize("1-of-2", budget={"max_asset_cost": 1.0})
    assert _cost(done)[md.COST_ASSET_TOTAL_USD] == pytest.approx(80 * ROW_USD)


def test_the_sensor_still_retries_a_shard_that_failed_for_another_reason(tmp_path: Path) -> None:
    df = tickets(40)
    poison = {ids_in_shard(df, 0, 2)[0]}
    fails = poisoned(poison)
    job = _job(tmp_path, df, fn=lambda batch: priced(batch, fails), max_run_cost=0.01)
    # Shard 0 fails for a row the function cannot do; shard 1 at its spend limit.
    assert not job.materialize("0-of-2", raise_on_error=False, budget={"max_run_cost": 1}).success
    assert not job.materialize("1-of-2", raise_on_error=False).success
    sensor = failed_partitions_sensor(job.asset, backoff_seconds=0)
    defs = dg.Definitions(
        assets=[job.source, job.asset], sensors=[sensor], resources=job.resources()
    )
    tick = sensor.evaluate_tick(dg.build_sensor_context(instance=job.instance, definitions=defs))
    assert [r.partition_key for r in tick.run_requests or []] == ["0-of-2"]


def test_a_running_shard_sees_what_another_shard_spends_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spend, "REFRESH_SECONDS", 0.0)  # read the others after every call
    df = tickets(80)
    calls: list[int] = []
    instance: list[dg.DagsterInstance] = []

    def meanwhile(batch: pl.DataFrame) -> pl.DataFrame:
        calls.append(batch.height)
        if len(calls) == 2:  # shard 0, running in another process, has spent 0.5 USD by now
            instance[0].report_runless_asset_event(
                dg.AssetObservation(
                    dg.AssetKey(ASSET), partition="0-of-2", metadata={md.COST_SHARD_TOTAL_USD: 0.5}
                )
            )
        return priced(batch)

    job = _job(tmp_path, df, fn=meanwhile, max_asset_cost=0.4)
    instance.append(job.instance)
    stopped = job.materialize("1-of-2", raise_on_error=False)
    assert "max_asset_cost is 0.4000 USD and the asset (every shard and run) has spent 0.5160" in (
        step_error(stopped)
    )
    # Read after the second call's result: no call starts after it.
    assert len(calls) == 2
    assert job.checkpoint("1-of-2").load("ticket_id").rows.height == 8
    # And while it ran, it showed the other shards what it had spent so far.
    records = job.instance.fetch_observations(
        dg.AssetRecordsFilter(dg.AssetKey(ASSET), asset_partitions=["1-of-2"]), limit=10
    ).records
    running = [r.asset_observation.metadata for r in records if r.asset_observation]
    shown = [md.plain(m[md.COST_SHARD_TOTAL_USD]) for m in running if "stopped_by" not in m]
    assert shown == [pytest.approx(0.016), pytest.approx(0.008)]  # newest first
