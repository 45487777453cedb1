"""A dry run (``dry_run: true`` in run config) in Dagster: what it reads besides the shards, and
how it ends.

It reads what the endpoint resource adds to every request (``requests``). For a request/parse
asset, it also reads the rows of the checkpoint's open provider batch submissions
(``submitted``). A run collects those without sending them again.

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

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import dagster as dg
import polars as pl

from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.layout import UNPARTITIONED
from checkpoint_assets.engine.plan.estimate import Estimate, Requests
from checkpoint_assets.engine.providers.submission_records import Records
from checkpoint_assets.engine.rows import INPUT_HASH
from checkpoint_assets.integration import metadata as md


def requests(
    request: Callable[[dict[str, Any]], Mapping[str, Any]] | None, resources: Iterable[Any]
) -> Requests:
    """How the rows become requests: ``request`` (a request/parse asset's), and what the first
    endpoint resource (one with ``request_defaults()``) adds to each: its model, ``max_tokens``."""
    for resource in resources:
        defaults = getattr(resource, "request_defaults", None)
        if callable(defaults):
            return Requests(request, dict(defaults()))
    return Requests(request)


def submitted(
    checkpoint: Checkpoint | None, id_column: str, requests: Requests
) -> pl.DataFrame | None:
    """The id and input hash of the rows in ``checkpoint``'s open provider batch submissions
    (None: not a request/parse asset, or no checkpoint)."""
    if checkpoint is None or requests.body is None:
        return None
    sent = [s for s in Records(checkpoint.store, checkpoint.files).load() if s.open]
    ids = pl.Series(id_column, [i for s in sent for i in s.ids])
    hashes = pl.Series(INPUT_HASH, [h for s in sent for h in s.hashes], dtype=pl.UInt64)
    return pl.DataFrame([ids, hashes])


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
