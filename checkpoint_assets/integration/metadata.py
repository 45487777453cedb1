"""Metadata keys: what a checkpointed asset's definition declares and each materialization
records, named once here and read by the sensor, the checks and the IO manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import dagster as dg
import polars as pl

from checkpoint_assets.engine.fields import DOC
from checkpoint_assets.engine.plan.estimate import Estimate
from checkpoint_assets.engine.rows import ERROR
from checkpoint_assets.engine.settings import RunStats
from checkpoint_assets.engine.storage.base import Usage

# Definition metadata, set by the decorators.
ID_COLUMN = "checkpoint_assets/id_column"
SOURCE = "checkpoint_assets/source"
RETRY_FAILED = "checkpoint_assets/retry_failed"
PROVIDER = "checkpoint_assets/provider"  # a provider batch asset's resource key
ENDPOINT = "checkpoint_assets/endpoint"  # and its endpoint, when it names one
GLOBAL_RESUME_OF = "checkpoint_assets/global_resume_of"

# Materialization metadata (besides the counts of ``COUNTS``).
ROWS_FAILED = "rows_failed"
CHECKPOINT_TAG = "checkpoint_tag"
CHECKPOINTING = "checkpointing"
THROTTLED_CALLS = "throttled_calls"
THROTTLE_EVENTS = "throttle_events"
THROTTLED_SECONDS = "throttled_seconds"
CONCURRENCY_FINAL = "concurrency_final"
REFUSALS_PER_ANSWER = "refusals_per_answer"
BUDGET_USED = "budget_used"
BUDGET_WAIT_SECONDS = "budget_wait_seconds"
USAGE = "usage/"  # + a usage column
USAGE_TOTAL = "usage_total/"  # + a usage column
COST_USD = "cost_usd"
COST_BY_MODEL = "cost_by_model"
COST_SHARD_TOTAL_USD = "cost_shard_total_usd"
COST_ASSET_TOTAL_USD = "cost_asset_total_usd"
ROWS_PER_SECOND = "rows_per_second"
CHECKPOINT_PATH = "checkpoint_path"
STORAGE_REQUESTS = "storage_requests/"  # + a request kind, lower case
REQUEST_KINDS = ("PUT", "GET", "LIST", "DELETE", "HEAD")
STORAGE_BYTES_READ = "storage_bytes_read"
STORAGE_WAIT_SECONDS = "storage_wait_seconds"
INPUT_FINGERPRINT = "input_fingerprint"
TOP_ERRORS = "top_errors"
FUNCTION_CHANGED = "function_changed"
FUNCTION_CHANGES = "function_changes"
# A request/parse asset (provider_batch_asset): how the run asked its rows.
MODE = "mode"
ROWS_ONLINE = "rows_online"
BATCH_RESULTS_DROPPED = "batch_results_dropped"
COST_SAVED_USD = "cost_saved_usd"
ROWS_REPARSED = "rows_reparsed"
ROWS_WITHOUT_ANSWER = "rows_without_answer"
# Provider batches and the provider's queue (engine/providers/queue.py).
SUBMISSIONS_REFUSED = "submissions_refused"
QUEUE_WAIT_SECONDS = "queue_wait_seconds"
QUEUE_USE = "queue_use"
ROWS_WAITING_FOR_QUEUE = "rows_waiting_for_queue"
# The failure of a run that submitted and ended: when the provider ends the last of its batches
# at the latest (their 24 h window), and which sensor collects them.
RESULTS_DUE_BY = "results_due_by"
COLLECTED_BY = "collected_by"
# Dagster's standard keys (shown in the UI's asset overview and columns tab).
ROW_COUNT = "dagster/row_count"
COLUMN_SCHEMA = "dagster/column_schema"
# Observation metadata: a run that stopped records what its checkpoint holds; a provider batch
# run that submitted and ended records what it waits for (``provider_batches_sensor`` follows it).
ROWS_CHECKPOINTED = "rows_checkpointed"
STOPPED_BY = "stopped_by"
BATCHES_PENDING = "batches_pending"
ROWS_PENDING = "rows_pending"
COUNTS = (
    "rows_total",
    "rows_computed",
    "rows_resumed",
    ROWS_FAILED,
    "rows_reused",
    "rows_dropped",
    "rows_changed",
    "rows_imported",
    "rows_from_store",
    "calls",
)

# Every key a checkpointed asset records, with its meaning. The docs' metadata reference is made
# from these tables, and ``declared`` refuses a key that is not in them. ``<...>`` stands for any
# name.
MATERIALIZATION: dict[str, str] = {
    "rows_total": "Input rows of the partition.",
    "rows_computed": "Rows the function computed in this run, successes and failures.",
    "rows_resumed": "Rows taken from the checkpoint instead of computed.",
    ROWS_FAILED: "Rows of the result stored as failed (`_error` not null), whenever computed.",
    "rows_reused": "Rows that got the result of an identical input (`dedupe`).",
    "rows_dropped": "Stored rows whose id is no longer in the input. They are left out of the "
    "result and kept in storage.",
    "rows_changed": "Finished rows whose input changed, computed again "
    "(`on_input_change: recompute`). They count in `rows_computed` too.",
    "rows_imported": "Rows taken from `<asset>_global_resume` (`global_resume: true`).",
    "rows_from_store": "Rows taken from the result store instead of computed (`reuse`): the "
    "same function and input, stored by any asset, tag or id.",
    COST_SAVED_USD: "With `reuse` and a `budget`: what the rows taken from the result store "
    "cost when they were computed, at the budget's prices.",
    "calls": "Calls of the function in this run, retries and splits included. Through provider "
    "batches: the requests submitted.",
    ROWS_PER_SECOND: "`rows_computed` per second of the run. Absent when it computed nothing.",
    INPUT_FINGERPRINT: "BLAKE3 fingerprint of the partition's ids and input columns.",
    CHECKPOINT_TAG: "The checkpoint tag the run wrote.",
    CHECKPOINTING: "`false` for a run with `checkpointing: false`.",
    CHECKPOINT_PATH: "Where the checkpoint is: a path, or a URI on object storage.",
    STORAGE_REQUESTS + "<kind>": "Storage requests the run made, one number per kind: `put`, "
    "`get`, `list`, `delete`, `head`. Ranged reads of a stored source count too.",
    STORAGE_BYTES_READ: "Bytes the run's GETs fetched, its slice of a stored source included. "
    "Polars' own reads of local files are not counted.",
    STORAGE_WAIT_SECONDS: "How long checkpointing held the run up: waiting for a flush, then "
    "finalize. When it is a large share of the run, raise `checkpoint_interval` or "
    "`min_flush_seconds`.",
    THROTTLED_CALLS: "Calls the endpoint refused (`RetryAfter`, HTTP 429/503/529). Each waited "
    "and was sent again.",
    REFUSALS_PER_ANSWER: "`throttled_calls` per call the endpoint answered.",
    BUDGET_USED: "The share of the API key's rate limits (stated in the endpoint's headers, or "
    "set on the resource) this run used while it called: the limit and its refill over that "
    "time. Present when a rate limit was known.",
    BUDGET_WAIT_SECONDS: "Time during which requests waited for room under the API key's rate "
    "limits.",
    THROTTLED_SECONDS: "Time the whole shard was paused by rate limits.",
    THROTTLE_EVENTS: "Times the shard lowered its concurrency or paused as a whole.",
    CONCURRENCY_FINAL: "Calls in flight allowed at the end of the run.",
    USAGE + "<col>": "Sum of the usage column over this run's computed rows.",
    USAGE_TOTAL + "<col>": "Sum of the usage column over every stored row of the partition.",
    COST_USD: "With a `budget`: what this run's calls on the shard cost, in USD. Provider "
    "batches at the batch price.",
    COST_BY_MODEL: "With a `budget`: `cost_usd` by model (JSON).",
    COST_SHARD_TOTAL_USD: "With a `budget`: what the shard cost over every run, failed runs "
    "included.",
    COST_ASSET_TOTAL_USD: "With a `budget`: what the asset cost over every shard and run, as of "
    "this materialization.",
    TOP_ERRORS: "When rows failed: the most common errors, with their count and sample ids.",
    FUNCTION_CHANGED: "`true` when stored results were reused although the function changed and "
    "`code_version` did not. Absent with `checkpointing: false`.",
    FUNCTION_CHANGES: "When `function_changed`: what changed, such as `the function's code`.",
    MODE: "A request/parse asset: how the run asked its rows, `online`, `batch` or `hybrid`.",
    ROWS_ONLINE: "A request/parse asset: rows this run asked online, one request each. They "
    "count in `rows_computed` too.",
    BATCH_RESULTS_DROPPED: "A request/parse asset: provider batch results dropped because their "
    "row was stored already. Such a row is stored once.",
    ROWS_REPARSED: "Provider batches, when `parse` changed: stored answers parsed again, with "
    "no request.",
    ROWS_WITHOUT_ANSWER: "Provider batches, when `parse` changed: finished rows with no stored "
    "answer. They keep their outputs unless the run sets `recompute_unanswered: true`.",
    SUBMISSIONS_REFUSED: "Provider batches: submissions the provider refused for want of room "
    "in its queue. Nothing of them ran or was billed; their rows were submitted again.",
    QUEUE_WAIT_SECONDS: "Provider batches: seconds the run waited for room in the provider's "
    "queue.",
    QUEUE_USE: "Provider batches, when the queue's limit is known: the highest share of it "
    "that the submissions of every shard on the key took when the run looked.",
    ROW_COUNT: "Rows of the partition's result, failed ones included (Dagster's standard key).",
    COLUMN_SCHEMA: "The result's columns and types: the id, the outputs and `_error` "
    "(Dagster's standard key).",
}
OBSERVATION: dict[str, str] = {
    ROWS_CHECKPOINTED: "A run that stopped: rows its checkpoint holds, earlier runs' included.",
    ROWS_FAILED: "A run that stopped: rows stored as failed.",
    CHECKPOINT_PATH: "A run that stopped: where its checkpoint is.",
    STOPPED_BY: "A run that stopped: the class of the error that stopped it.",
    BATCHES_PENDING: "A provider batch run that submitted and ended: the provider's ids of the "
    "batches the partition waits for (JSON list). `provider_batches_sensor` follows it.",
    ROWS_PENDING: "A provider batch run that submitted and ended: rows in those batches.",
    ROWS_WAITING_FOR_QUEUE: "A provider batch run that submitted and ended: rows the "
    "provider's queue had no room for yet, which a later run submits.",
    COST_USD: "With a `budget`, a run that spent and stopped, or a running shard under "
    "`max_asset_cost`: what the shard's calls cost so far in this run.",
    COST_BY_MODEL: "With a `budget`, a run that spent and stopped: `cost_usd` by model.",
    COST_SHARD_TOTAL_USD: "With a `budget`: what the shard cost over every run.",
    COST_ASSET_TOTAL_USD: "With a `budget`, a run that spent and stopped: what the asset cost.",
}

# The failure of a run of several shards (a ranged run) in which some failed.
SHARDS = "shards"
SHARDS_FAILED = "shards_failed"
RANGED_FAILURE: dict[str, str] = {
    SHARDS: "One row per shard of the run: its outcome (`materialized`, `failed`, or `not run` "
    "when `stop_at_failed_shard` stopped the run before it), the rows it computed and stored as "
    "failed, and the error of a failed shard.",
    SHARDS_FAILED: "The shards that failed (JSON list), which `failed_partitions_sensor` retries.",
}

# The failure of a provider batch run that submitted and ended (``wait: false``).
PENDING_FAILURE: dict[str, str] = {
    ROWS_PENDING: "Rows that wait in provider batches.",
    BATCHES_PENDING: "The provider's ids of those batches (JSON list).",
    ROWS_WAITING_FOR_QUEUE: "Rows the provider's queue had no room for yet: a later run "
    "submits them.",
    RESULTS_DUE_BY: "When the provider ends the last of them at the latest (its 24 h window).",
    COLLECTED_BY: "The `provider_batches_sensor` that requests the run collecting them.",
}


def declared(metadata: dict[str, Any], table: dict[str, str]) -> dict[str, Any]:
    """``metadata`` itself, once each of its keys is declared in ``table``."""
    prefixes = tuple(k.partition("<")[0] for k in table if "<" in k)
    unknown = [k for k in metadata if k not in table and not k.startswith(prefixes)]
    if unknown:
        raise RuntimeError(
            f"Metadata keys {unknown} are not declared: add them, with their meaning, to the "
            "tables of checkpoint_assets/integration/metadata.py."
        )
    return metadata


TOP_ERRORS_SHOWN = 10
SAMPLE_IDS = 5


def materialization(
    runs: Sequence[RunStats],
    tag: str,
    checkpointing: bool,
    storage: Usage,
    result: pl.DataFrame | None = None,
    id_column: str | None = None,
) -> dict[str, Any]:
    """The metadata of one materialization (of each shard in a ranged run: ``runs`` holds one).

    ``storage``: what the step asked of storage (reading its source's row groups, its
    checkpoints), counted by the store.

    ``result``: what the asset returns (id, outputs, ``_error``), for Dagster's standard
    ``dagster/row_count`` and ``dagster/column_schema`` and the table of the most common errors.
    """
    out: dict[str, Any] = {k: sum(getattr(r, k) for r in runs) for k in COUNTS}
    seconds = sum(r.seconds for r in runs)
    if out["rows_computed"] and seconds > 0:  # absent on a run that computed nothing
        out[ROWS_PER_SECOND] = round(out["rows_computed"] / seconds, 2)
    out[INPUT_FINGERPRINT] = ",".join(r.input_fingerprint for r in runs)
    out[CHECKPOINT_TAG] = tag
    out[CHECKPOINTING] = checkpointing
    paths = [r.checkpoint_path for r in runs if r.checkpoint_path]
    if paths:
        out[CHECKPOINT_PATH] = dg.MetadataValue.path(
            paths[0] if len(paths) == 1 else ", ".join(paths)
        )
    requests = {**dict.fromkeys(REQUEST_KINDS, 0), **storage.requests}
    for kind, n in requests.items():  # one number per kind, which the UI plots over time
        out[STORAGE_REQUESTS + kind.lower()] = n
    out[STORAGE_BYTES_READ] = storage.bytes_read
    out[STORAGE_WAIT_SECONDS] = round(sum(r.storage_wait_seconds for r in runs), 3)
    if result is not None:
        out[ROW_COUNT] = result.height
        out[COLUMN_SCHEMA] = column_schema(result, id_column)
        if (
            id_column
            and ERROR in result.columns
            and result.get_column(ERROR).null_count() < (result.height)
        ):
            out[TOP_ERRORS] = top_errors(result, id_column)
    out.update(_throttling(runs))
    out.update(_usage(runs))
    out.update(_modes(runs))
    saved = [r.cost_saved_usd for r in runs if r.cost_saved_usd is not None]
    if saved:
        out[COST_SAVED_USD] = round(sum(saved), 6)
    if checkpointing:  # without a checkpoint there is no earlier function to compare with
        out.update(_function(runs))
    return declared(out, MATERIALIZATION)


def _modes(runs: Sequence[RunStats]) -> dict[str, Any]:
    modes = list(dict.fromkeys(r.mode for r in runs if r.mode is not None))
    if not modes:
        return {}
    out: dict[str, Any] = {
        MODE: ",".join(modes),
        ROWS_ONLINE: sum(r.rows_online for r in runs),
        BATCH_RESULTS_DROPPED: sum(r.batch_results_dropped for r in runs),
    }
    if "online" not in modes or len(modes) > 1:
        out[SUBMISSIONS_REFUSED] = sum(r.submissions_refused for r in runs)
        out[QUEUE_WAIT_SECONDS] = round(sum(r.queue_wait_seconds for r in runs), 3)
    used = [r.queue_use for r in runs if r.queue_use is not None]
    if used:
        out[QUEUE_USE] = max(used)
    return out


def _function(runs: Sequence[RunStats]) -> dict[str, Any]:
    changed = list(dict.fromkeys(c for r in runs for c in r.function_changed))
    if not changed:
        return {FUNCTION_CHANGED: False}
    out: dict[str, Any] = {FUNCTION_CHANGED: True, FUNCTION_CHANGES: ", ".join(changed)}
    reparsed = sum(r.rows_reparsed for r in runs)
    unanswered = sum(r.rows_without_answer for r in runs)
    if reparsed or unanswered:
        out |= {ROWS_REPARSED: reparsed, ROWS_WITHOUT_ANSWER: unanswered}
    return out


def _throttling(runs: Sequence[RunStats]) -> dict[str, Any]:
    throttled, answered = sum(r.throttled_calls for r in runs), sum(r.calls for r in runs)
    out: dict[str, Any] = {
        THROTTLED_CALLS: throttled,
        THROTTLE_EVENTS: sum(r.throttle_events for r in runs),
        THROTTLED_SECONDS: round(sum(r.throttled_seconds for r in runs), 3),
        CONCURRENCY_FINAL: min((r.concurrency_final for r in runs), default=0),
        BUDGET_WAIT_SECONDS: round(sum(r.budget_wait_seconds for r in runs), 3),
    }
    if answered:
        out[REFUSALS_PER_ANSWER] = round(throttled / answered, 4)
    paced = [r for r in runs if r.budget_used is not None]
    if paced:  # a ranged run's shards one after the other: weighted by their time
        seconds = sum(r.seconds for r in paced)
        used = [(r.budget_used or 0.0) * (r.seconds if seconds else 1) for r in paced]
        out[BUDGET_USED] = round(sum(used) / (seconds or len(paced)), 4)
    return out


def _usage(runs: Sequence[RunStats]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in runs:
        for prefix, sums in ((USAGE, r.usage), (USAGE_TOTAL, r.usage_total)):
            for column, value in sums.items():
                out[prefix + column] = out.get(prefix + column, 0.0) + value
    return out


def column_schema(result: pl.DataFrame, id_column: str | None) -> dg.TableSchema:
    """The result's columns with their polars types: the id, the outputs and ``_error``."""

    def role(name: str) -> str:
        if name == id_column:
            return "row id"
        if name == ERROR:
            return "error of a failed row (null on success)"
        return "output"

    return dg.TableSchema(
        columns=[
            dg.TableColumn(name, str(dtype), description=role(name))
            for name, dtype in result.schema.items()
        ]
    )


def top_errors(result: pl.DataFrame, id_column: str) -> dg.TableMetadataValue:
    """The most common errors of the failed rows: message, rows, sample ids."""
    top = (
        result.filter(pl.col(ERROR).is_not_null())
        .group_by(ERROR)
        .agg(pl.len().alias("rows"), pl.col(id_column).sort().head(SAMPLE_IDS).alias("ids"))
        .sort(["rows", ERROR], descending=[True, False])
        .head(TOP_ERRORS_SHOWN)
    )
    records = [
        dg.TableRecord(
            {"error": error[:500], "rows": rows, "sample_ids": ", ".join(str(i) for i in ids)}
        )
        for error, rows, ids in top.iter_rows()
    ]
    schema = dg.TableSchema(
        columns=[
            dg.TableColumn("error", "string"),
            dg.TableColumn("rows", "int"),
            dg.TableColumn("sample_ids", "string"),
        ]
    )
    return dg.MetadataValue.table(records, schema=schema)


def plain(value: Any) -> Any:
    """A metadata entry's plain value (``MetadataValue`` or already plain)."""
    return value.value if isinstance(value, dg.MetadataValue) else value


# A dry run's observation of each partition (``dry_run: true``): ``ESTIMATE`` + a field of the
# engine's ``Estimate``, whose declaration says what it means.
ESTIMATE = "estimate/"
DRY_RUN: dict[str, str] = {ESTIMATE + f.name: f.metadata[DOC] for f in fields(Estimate)}


def estimate(found: Estimate) -> dict[str, Any]:
    """The metadata of one shard's estimate (a cost is absent without a budget)."""
    out = {ESTIMATE + k: v for k, v in found.as_dict().items() if v is not None}
    return declared(out, DRY_RUN)


def estimate_of(metadata: dict[str, Any]) -> Estimate:
    """The estimate an observation's plain ``metadata`` records (``estimate`` read back)."""
    names = {f.name for f in fields(Estimate)}
    found = {k.removeprefix(ESTIMATE): v for k, v in metadata.items() if k.startswith(ESTIMATE)}
    return Estimate(**{k: v for k, v in found.items() if k in names})
