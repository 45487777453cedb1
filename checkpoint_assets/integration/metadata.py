"""Metadata keys: what a checkpointed asset's definition declares and each materialization
records, named once here and read by the sensor, the checks and the IO manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dagster as dg

from checkpoint_assets.engine.settings import RunStats

# Definition metadata, set by the decorators.
ID_COLUMN = "checkpoint_assets/id_column"
SOURCE = "checkpoint_assets/source"
RETRY_FAILED = "checkpoint_assets/retry_failed"
GLOBAL_RESUME_OF = "checkpoint_assets/global_resume_of"

# Materialization metadata (besides the counts of ``COUNTS``).
ROWS_FAILED = "rows_failed"
CHECKPOINT_TAG = "checkpoint_tag"
CHECKPOINTING = "checkpointing"
THROTTLE_EVENTS = "throttle_events"
THROTTLED_SECONDS = "throttled_seconds"
CONCURRENCY_FINAL = "concurrency_final"
USAGE = "usage/"  # + a usage column: its sum over the rows this run computed
USAGE_TOTAL = "usage_total/"  # + a usage column: its sum over every stored row
COUNTS = (
    "rows_total",
    "rows_computed",
    "rows_resumed",
    ROWS_FAILED,
    "rows_reused",
    "rows_dropped",
    "rows_imported",
    "calls",
)


def materialization(runs: Sequence[RunStats], tag: str, checkpointing: bool) -> dict[str, Any]:
    """The metadata of one materialization; a ranged run of several shards reports their sums."""
    out: dict[str, Any] = {k: sum(getattr(r, k) for r in runs) for k in COUNTS}
    seconds = sum(r.seconds for r in runs)
    out["rows_per_second"] = round(out["rows_computed"] / seconds, 2) if seconds else 0.0
    out["input_fingerprint"] = ",".join(r.input_fingerprint for r in runs)
    out[CHECKPOINT_TAG] = tag
    out[CHECKPOINTING] = checkpointing
    paths = [r.checkpoint_path for r in runs if r.checkpoint_path]
    if paths:
        out["checkpoint_path"] = dg.MetadataValue.path(
            paths[0] if len(paths) == 1 else ", ".join(paths)
        )
    requests: dict[str, int] = {}
    for r in runs:
        for k, v in r.requests.items():
            requests[k] = requests.get(k, 0) + v
    out["storage_requests"] = requests
    out["storage_wait_seconds"] = round(sum(r.storage_wait_seconds for r in runs), 3)
    out.update(_throttling(runs))
    out.update(_usage(runs))
    return out


def _throttling(runs: Sequence[RunStats]) -> dict[str, Any]:
    return {
        THROTTLE_EVENTS: sum(r.throttle_events for r in runs),
        THROTTLED_SECONDS: round(sum(r.throttled_seconds for r in runs), 3),
        CONCURRENCY_FINAL: min((r.concurrency_final for r in runs), default=0),
    }


def _usage(runs: Sequence[RunStats]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in runs:
        for prefix, sums in ((USAGE, r.usage), (USAGE_TOTAL, r.usage_total)):
            for column, value in sums.items():
                out[prefix + column] = out.get(prefix + column, 0.0) + value
    return out


def plain(value: Any) -> Any:
    """A metadata entry's plain value (``MetadataValue`` or already plain)."""
    return value.value if isinstance(value, dg.MetadataValue) else value
