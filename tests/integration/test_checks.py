"""Asset checks of a checkpointed asset: completeness and failed rows, per shard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from helpers.jobs import Job, Storage, build_job, ids_in_shard, poisoned, tickets

from checkpoint_assets import CheckpointError, checkpoint_checks, shard_partitions

SHARDS = shard_partitions(2)


def run_with_checks(job: Job, partition: str, **config: Any) -> dict[str, dg.AssetCheckEvaluation]:
    """Materialize one shard with the asset's checks selected too (as the UI does)."""
    result = dg.materialize(
        [job.source, job.asset, *checkpoint_checks(job.asset)],
        instance=job.instance,
        resources=job.resources(),
        partition_key=partition,
        run_config={"ops": {"routed": {"config": config}}} if config else None,
    )
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def values(evaluation: dg.AssetCheckEvaluation) -> dict[str, Any]:
    return {k: v.value for k, v in evaluation.metadata.items()}


def test_checks_report_failed_rows_and_missing_ids_per_shard(storage: Storage) -> None:
    df = tickets(60)
    bad = ids_in_shard(df, 1, 2)[:2]
    poison = set(bad)
    job = build_job(
        storage,
        df,
        fn=poisoned(poison, "model refused the ticket"),
        partitions_def=SHARDS,
        max_failed_fraction=0.5,
    )

    clean = run_with_checks(job, "0-of-2")
    assert clean["completeness"].passed and clean["failed_rows"].passed
    assert values(clean["completeness"])["rows_expected"] == len(ids_in_shard(df, 0, 2))
    assert values(clean["completeness"])["rows_ok"] == len(ids_in_shard(df, 0, 2))

    dirty = run_with_checks(job, "1-of-2")
    completeness, failed = dirty["completeness"], dirty["failed_rows"]
    assert not completeness.passed and completeness.severity == dg.AssetCheckSeverity.WARN
    assert values(completeness)["rows_failed"] == 2
    assert values(completeness)["rows_missing"] == 0
    assert values(completeness)["sample_failed_ids"] == ", ".join(map(str, sorted(bad)))
    assert not failed.passed
    assert values(failed)["rows_failed"] == 2
    table = values(failed)["top_errors"]
    assert "| 2 | ValueError: model refused the ticket |" in table
    assert all(str(i) in table for i in bad)

    poison.clear()
    fixed = run_with_checks(job, "1-of-2")
    assert fixed["completeness"].passed and fixed["failed_rows"].passed


def test_completeness_fails_when_input_ids_were_never_computed(storage: Storage) -> None:
    df = tickets(60)
    job = build_job(storage, df, partitions_def=SHARDS)

    limited = run_with_checks(job, "0-of-2", limit=5)

    completeness = limited["completeness"]
    assert not completeness.passed and completeness.severity == dg.AssetCheckSeverity.ERROR
    assert values(completeness)["rows_missing"] == len(ids_in_shard(df, 0, 2)) - 5
    assert values(completeness)["rows_ok"] == 5
    assert limited["failed_rows"].passed


def test_an_unpartitioned_asset_is_checked_as_a_whole(storage: Storage) -> None:
    job = build_job(storage, tickets(30))
    result = dg.materialize(
        [job.source, job.asset, *checkpoint_checks(job.asset)],
        instance=job.instance,
        resources=job.resources(),
    )
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert evaluations["completeness"].passed
    assert values(evaluations["completeness"])["rows_expected"] == 30


def test_checks_sit_next_to_the_asset_and_need_a_checkpointed_one(tmp_path: Path) -> None:
    job = build_job((str(tmp_path), {}), tickets(4), partitions_def=SHARDS)
    checks = checkpoint_checks(job.asset)
    keys = {key for check in checks for key in check.check_keys}
    assert keys == {
        dg.AssetCheckKey(job.asset.key, "completeness"),
        dg.AssetCheckKey(job.asset.key, "failed_rows"),
    }
    defs = dg.Definitions(
        assets=[job.source, job.asset], asset_checks=checks, resources=job.resources()
    )
    assert defs.resolve_asset_graph().asset_check_keys == keys

    with pytest.raises(CheckpointError, match="@checkpointed_asset"):
        checkpoint_checks(job.source)
