"""A ranged run (several shards in one run, as a backfill with a ``backfill_policy`` launches):
each shard's outcome, and the run's failure naming the shards that failed.

Dagster records a ranged step's output as one materialization per partition of its range, and
only when the step succeeds: one failed shard would leave every shard of the range without one.
So each shard that finishes is recorded at once with ``context.log_event(AssetMaterialization(
partition=...))``, Dagster's public way to materialize one partition from within a step. The
partition status, the UI's partition bar, asset backfills and ``failed_partitions_sensor`` all
read those events: a shard that finished shows materialized, the others failed (their
planned materialization has none in a run that failed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import dagster as dg

from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.settings import RunStats
from checkpoint_assets.integration import metadata as md

MATERIALIZED = "materialized"
FAILED = "failed"
NOT_RUN = "not run"
_ERROR_CHARS = 500  # of each failed shard's error, in the run's failure


@dataclass(frozen=True)
class ShardOutcome:
    """How one shard of a ranged run ended."""

    key: str | None
    outcome: str  # MATERIALIZED, FAILED or NOT_RUN
    error: CheckpointError | None = None
    stats: RunStats | None = None


def ranged_failure(
    context: dg.AssetExecutionContext, outcomes: Sequence[ShardOutcome]
) -> dg.Failure:
    """The failure of a ranged run in which some shards failed: which, why, and what to do;
    its metadata holds a table of every shard's outcome."""
    label = context.asset_key.to_user_string()
    failed = [o for o in outcomes if o.outcome == FAILED]
    not_run = [o for o in outcomes if o.outcome == NOT_RUN]
    done = [o for o in outcomes if o.outcome == MATERIALIZED]
    by_error: dict[str, list[str]] = {}
    for outcome in failed:
        by_error.setdefault(_said(outcome.error), []).append(str(outcome.key))
    lines = [
        f"{len(failed)} of {len(outcomes)} shards of {label} failed: "
        f"{', '.join(str(o.key) for o in failed)}."
    ]
    lines += [f"- {', '.join(keys)}: {error}" for error, keys in by_error.items()]
    if done:
        lines.append(f"{len(done)} materialized: {_span([str(o.key) for o in done])}.")
    if not_run:
        lines.append(
            f"{len(not_run)} not run (stop_at_failed_shard): "
            f"{_span([str(o.key) for o in not_run])}."
        )
    lines.append(
        "Fix the cause, then run the failed shards again (failed_partitions_sensor retries "
        "them): each resumes from its checkpoint."
    )
    metadata = {
        md.SHARDS: _table(outcomes),
        md.SHARDS_FAILED: dg.MetadataValue.json([o.key for o in failed]),
    }
    return dg.Failure(
        description="\n".join(lines), metadata=md.declared(metadata, md.RANGED_FAILURE)
    )


def read_in_run(context: dg.AssetExecutionContext) -> bool:
    """Whether another step of this run reads the asset's output: an asset downstream of it,
    or an asset check of it, in the run's job (which holds only the run's selection)."""
    layer = context.job_def.asset_layer
    graph = layer.asset_graph
    key = context.asset_key
    if graph.get(key).child_keys & (set(layer.executable_asset_keys) - {key}):
        return True
    return any(check.asset_key == key for check in graph.asset_check_keys)


def _table(outcomes: Sequence[ShardOutcome]) -> dg.TableMetadataValue:
    columns = [
        dg.TableColumn("shard", "string"),
        dg.TableColumn("outcome", "string"),
        dg.TableColumn("rows_computed", "int"),
        dg.TableColumn("rows_failed", "int"),
        dg.TableColumn("error", "string"),
    ]
    records = [
        dg.TableRecord(
            {
                "shard": str(o.key),
                "outcome": o.outcome,
                "rows_computed": o.stats.rows_computed if o.stats else 0,
                "rows_failed": o.stats.rows_failed if o.stats else 0,
                "error": _said(o.error) if o.error else "",
            }
        )
        for o in outcomes
    ]
    return dg.MetadataValue.table(records, dg.TableSchema(columns=columns))


def _said(error: CheckpointError | None) -> str:
    text = f"{type(error).__name__}: {error}" if error else ""
    return text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 1] + "…"


def _span(keys: Sequence[str]) -> str:
    """Keys as a short list: every one up to eight, else the first and last few."""
    if len(keys) <= 8:
        return ", ".join(keys)
    return f"{', '.join(keys[:3])}, ... {', '.join(keys[-2:])}"
