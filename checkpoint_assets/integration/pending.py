"""How a run that submitted rows to provider batches and did not wait for them ends in Dagster.

The step fails with a ``dg.Failure`` whose description says that nothing is lost and what
happens next, and the run carries the tag ``checkpoint_assets/batches_pending`` (the rows left),
which ``failed_partitions_sensor`` reads as "not a failure: do not retry". Each shard's pending
batches are recorded as an ``AssetObservation`` of its partition (``batches_pending``: their ids),
which ``provider_batches_sensor`` follows to request the run that collects them once they end.

Why a failure rather than a skipped output: the partition must not count as materialized (its
rows are not all there), and a failed step shows at once, with its description, in the run's
page and the partition's history; a skipped output leaves a green run whose asset did not
materialize, which reads like success.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import dagster as dg

from checkpoint_assets.engine.errors import BatchesPendingError
from checkpoint_assets.engine.layout import UNPARTITIONED
from checkpoint_assets.integration import metadata as md

PENDING_TAG = "checkpoint_assets/batches_pending"


def end_pending(
    context: dg.AssetExecutionContext,
    pending: Mapping[str | None, BatchesPendingError],
) -> dg.Failure:
    """Record the pending batches of each shard, tag the run, and return the step's failure."""
    rows = sum(e.rows for e in pending.values())
    batches = [b for e in pending.values() for b in e.batches]
    for partition, error in pending.items():
        context.log_event(
            dg.AssetObservation(
                asset_key=context.asset_key,
                partition=partition,
                metadata=md.declared(
                    {md.BATCHES_PENDING: json.dumps(error.batches), md.ROWS_PENDING: error.rows},
                    md.OBSERVATION,
                ),
            )
        )
        context.log.info(str(error))
    context.instance.add_run_tags(context.run.run_id, {PENDING_TAG: str(rows)})
    shards = ", ".join(p or UNPARTITIONED for p in pending)
    return dg.Failure(
        description=(
            f"Submitted, not materialized yet: {rows:,} row(s) of {shards} wait in "
            f"{len(batches)} provider batch(es), recorded in the checkpoint; nothing is lost and "
            "nothing will be submitted again. provider_batches_sensor requests the run that "
            "collects them once they end (failed_partitions_sensor does not retry this run); "
            "or materialize the partition again later, or with `wait: true` to wait for them."
        ),
        metadata=md.declared(
            {md.ROWS_PENDING: rows, md.BATCHES_PENDING: json.dumps(batches)}, md.OBSERVATION
        ),
        allow_retries=False,
    )
