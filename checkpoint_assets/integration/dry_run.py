"""How a dry run (``dry_run: true`` in run config) ends in Dagster.

Each shard's estimate (``engine/plan/estimate.py``) is recorded as an ``AssetObservation`` of its
partition (keys ``estimate/...``, ``metadata.DRY_RUN``), and the total is logged. The step then
ends green with no output: the asset declares its output optional (``output_required=False``), so
nothing materializes and assets downstream in the same run are skipped.

Why not a failure, as ``pending.py`` ends a run that submitted provider batches: a dry run did
what it was asked. A failed step would show its partitions as failed in the UI, and
``failed_partitions_sensor`` would run them for real. A run that yields no output leaves each
partition's status as it was.
"""

from __future__ import annotations

from collections.abc import Mapping

import dagster as dg

from checkpoint_assets.engine.checkpoints.layout import UNPARTITIONED
from checkpoint_assets.engine.plan.estimate import Estimate
from checkpoint_assets.integration import metadata as md


def report(context: dg.AssetExecutionContext, estimates: Mapping[str | None, Estimate]) -> None:
    """Record each shard's estimate as an observation of its partition; log them and the total."""
    label = context.asset_key.to_user_string()
    for partition, found in estimates.items():
        context.log_event(
            dg.AssetObservation(
                asset_key=context.asset_key, partition=partition, metadata=md.estimate(found)
            )
        )
        context.log.info(f"Dry run of {label} {partition or UNPARTITIONED}: {found.summary()}.")
    total = Estimate.total(estimates.values())
    shards = f"{len(estimates)} shard(s)"
    context.log.info(
        f"Dry run of {label}, {shards} in total: {total.summary()}. Nothing was computed or "
        "written, and nothing materialized: run again without `dry_run` to compute them."
    )
