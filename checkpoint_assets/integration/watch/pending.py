"""How a run that submitted rows to provider batches and did not wait for them ends in Dagster.

The step fails with a ``dg.Failure``. Its description and metadata say what waits (rows,
batches), by when the provider ends it, and which sensor collects it. The run carries the tag
``checkpoint_assets/batches_pending`` (the rows left). ``failed_partitions_sensor`` reads that tag
as "not a failure: do not retry". Each shard's pending batches are recorded as an
``AssetObservation`` of its partition (``batches_pending``: their ids), with the rows the
provider's queue had no room for yet (``rows_waiting_for_queue``). ``provider_batches_sensor``
follows those to request the run that collects them once they end, and submits the rows that
waited.

Why a failure rather than a skipped output:

- The partition must not count as materialized: its rows are not all there.
- A failed step shows at once, with its description, in the run's page and the partition's
  history.
- A skipped output leaves a green run whose asset did not materialize, which reads like success.
  An asset backfill would count such a run's partition neither done nor failed.

Dagster logs a failed step with its stack; the description comes first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from checkpoint_assets.engine.checkpoints.layout import UNPARTITIONED
from checkpoint_assets.engine.errors import BatchesPendingError
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.watch.provider_sensor import sensor_name

PENDING_TAG = "checkpoint_assets/batches_pending"


def end_pending(
    context: dg.AssetExecutionContext,
    pending: Mapping[str | None, BatchesPendingError],
) -> dg.Failure:
    """Record the pending batches of each shard, tag the run, and return the step's failure."""
    rows = sum(e.rows for e in pending.values())
    waiting = sum(e.unsubmitted for e in pending.values())
    batches = [b for e in pending.values() for b in e.batches]
    due = max((e.due for e in pending.values() if e.due is not None), default=None)
    for partition, error in pending.items():
        context.log_event(
            dg.AssetObservation(
                asset_key=context.asset_key,
                partition=partition,
                metadata=md.declared(
                    {
                        md.BATCHES_PENDING: json.dumps(error.batches),
                        md.ROWS_PENDING: error.rows,
                        md.ROWS_WAITING_FOR_QUEUE: error.unsubmitted,
                    },
                    md.OBSERVATION,
                ),
            )
        )
        context.log.info(str(error))
    context.instance.add_run_tags(context.run.run_id, {PENDING_TAG: str(rows + waiting)})
    shards = ", ".join(p or UNPARTITIONED for p in pending)
    sensor = sensor_name(context.asset_key)
    shown = ", ".join(batches[:3]) + (", ..." if len(batches) > 3 else "")
    when = (
        f"The provider ends them by {_utc(due)} at the latest (its 24 h window), often sooner. "
        if due is not None
        else ""
    )
    metadata: dict[str, Any] = {
        md.ROWS_PENDING: rows,
        md.BATCHES_PENDING: json.dumps(batches),
        md.ROWS_WAITING_FOR_QUEUE: waiting,
        md.COLLECTED_BY: sensor,
    }
    if due is not None:
        metadata[md.RESULTS_DUE_BY] = dg.MetadataValue.timestamp(due)
    said = []
    if batches:
        said.append(
            f"{rows:,} row(s) of {shards} wait in {len(batches)} provider batch(es) ({shown}). "
            "They are recorded in the checkpoint: nothing is lost, and nothing will be "
            f"submitted again. {when}"
        )
    if waiting:
        said.append(
            f"{waiting:,} row(s) of {shards} wait for room in the provider's queue, which "
            "holds other batches: they are not submitted yet, and no row failed. "
        )
    return dg.Failure(
        description=(
            f"Submitted, not materialized yet: {''.join(said)}The sensor {sensor} "
            "(provider_batches_sensor) requests the partition's next run once batches end; "
            "failed_partitions_sensor does not retry this run. Or materialize the partition "
            "again later, or with `wait: true` to wait for them."
        ),
        metadata=md.declared(metadata, md.PENDING_FAILURE),
        allow_retries=False,
    )


def _utc(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M UTC")
