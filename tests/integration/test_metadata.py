"""What a materialization records (Dagster's standard keys beside ours), and what a failed or
interrupted run says it saved."""

from __future__ import annotations

from typing import Any

import dagster as dg
import pytest
from helpers.jobs import (
    ASSET,
    Storage,
    build_job,
    ids_in_shard,
    poisoned,
    route,
    run_logs,
    stats,
    tickets,
)

from checkpoint_assets import shard_partitions

REFUSED = "model refused the prompt"


def observations(instance: dg.DagsterInstance, run_id: str) -> list[dg.AssetObservation]:
    """The observations a run recorded (a failed step's are in the event log only)."""
    return [
        e.asset_observation
        for e in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_OBSERVATION)
        if e.asset_observation is not None
    ]


def test_a_materialization_records_dagsters_standard_keys_beside_ours(storage: Storage) -> None:
    job = build_job(storage, tickets(12), fn=poisoned({3, 7}, REFUSED), max_failed_fraction=0.5)
    materialization = job.materialize().asset_materializations_for_node(ASSET)[0]
    meta = materialization.metadata
    plain = {k: v.value for k, v in meta.items()}

    assert plain["dagster/row_count"] == 12  # the partition's result: every row, failed ones too
    schema = meta["dagster/column_schema"].value
    assert isinstance(schema, dg.TableSchema)
    assert [(c.name, c.type) for c in schema.columns] == [
        ("ticket_id", "Int64"),
        ("route", "String"),
        ("_error", "String"),
    ]
    assert isinstance(meta["checkpoint_path"], dg.PathMetadataValue)
    assert plain["checkpoint_path"].endswith("routed/default/all.parquet")

    errors = meta["top_errors"]
    assert isinstance(errors, dg.TableMetadataValue)
    assert [r.data for r in errors.records] == [
        {"error": f"ValueError: {REFUSED}", "rows": 2, "sample_ids": "3, 7"}
    ]

    requests = {k: v for k, v in plain.items() if k.startswith("storage_requests")}
    kinds = ("put", "get", "list", "delete", "head")
    assert set(requests) == {f"storage_requests/{k}" for k in kinds}
    assert all(isinstance(n, int) for n in requests.values())
    assert requests["storage_requests/put"] >= 3  # at least the lock, a part or merged, the meta
    assert plain["rows_per_second"] > 0
    assert (plain["rows_computed"], plain["rows_failed"]) == (12, 2)


def test_rows_per_second_is_absent_on_a_run_that_computed_nothing(storage: Storage) -> None:
    job = build_job(storage, tickets(8))
    job.materialize()

    again = stats(job.materialize())

    assert again["rows_computed"] == 0
    assert "rows_per_second" not in again
    assert again["dagster/row_count"] == 8
    assert "top_errors" not in again  # nothing failed


def test_a_failed_shard_says_what_it_saved_and_records_it_as_an_observation(
    storage: Storage,
) -> None:
    df = tickets(40)
    shards = shard_partitions(2)
    key = shards.get_partition_keys()[0]
    bad = set(ids_in_shard(df, 0, 2)[:2])
    job = build_job(storage, df, fn=poisoned(bad, REFUSED), partitions_def=shards)
    result = job.materialize(key, raise_on_error=False)
    assert not result.success

    stored = job.checkpoint(partition=key).read_result("ticket_id", ["route"])
    failed = stored["_error"].is_not_null().sum()
    ok = stored.height - failed
    assert ok > 0
    found = observations(job.instance, result.run_id)
    [observation] = [o for o in found if o.asset_key == dg.AssetKey(ASSET)]
    assert observation.partition == key
    metadata = {k: v.value for k, v in observation.metadata.items()}
    assert metadata["rows_checkpointed"] == ok
    assert metadata["rows_failed"] == failed
    assert metadata["stopped_by"] == "TooManyFailuresError"
    assert metadata["checkpoint_path"].endswith(f"routed/default/{key}.parquet")
    [line] = [m for m in run_logs(result, job.instance) if "rows are checkpointed at" in m]
    assert f"{ok:,} rows are checkpointed at " in line
    assert "again resumes" in line


def test_an_interrupted_run_says_what_it_saved(tmp_path: Any) -> None:
    calls: list[int] = []

    def interrupted(batch: Any) -> Any:
        calls.append(batch.height)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C, or Dagster terminating the run
        return route(batch)

    job = build_job((str(tmp_path / "checkpoints"), {}), tickets(20), fn=interrupted)
    with pytest.raises(BaseException) as stopped:
        job.materialize()
    assert isinstance(stopped.value, (KeyboardInterrupt, dg.DagsterExecutionInterruptedError))

    logs = [e.user_message for e in job.instance.all_logs(_last_run(job.instance))]
    [line] = [m for m in logs if "rows are checkpointed at" in m]
    assert "8 rows are checkpointed at " in line  # the two batches of 4 done before
    recorded = job.instance.fetch_observations(dg.AssetKey(ASSET), limit=1).records
    assert recorded[0].asset_observation is not None
    assert recorded[0].asset_observation.metadata["rows_checkpointed"].value == 8


def _last_run(instance: dg.DagsterInstance) -> str:
    return instance.get_runs(limit=1)[0].run_id
