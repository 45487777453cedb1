"""Asset checks of a checkpointed asset: completeness and failed rows, next to it in the UI.

Both checks read what a downstream asset would: the asset's result through its IO manager, one
row per processed id with ``_error``. For completeness, they also read the source rows of the
partition. They are partitioned like the asset, so each shard is checked on its own. They run
with the asset when it is selected in a run, or alone, from the asset's Checks tab.

No ``from __future__ import annotations`` here: Dagster reads the checks' annotations at runtime.
"""

import warnings
from collections.abc import Sequence
from typing import Any

import dagster as dg
import polars as pl

from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.plan.resume import canonical_ids, validate_ids
from checkpoint_assets.engine.rows import ERROR
from checkpoint_assets.engine.sharding.scheme import rows_in
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.store.source import as_lazy

SAMPLE = 5
_ERROR_CHARS = 200


def checkpoint_checks(asset: dg.AssetsDefinition) -> list[dg.AssetChecksDefinition]:
    """The ``completeness`` and ``failed_rows`` asset checks of a checkpointed asset.

    - ``completeness`` passes when every input id of the partition has a successful result. It
      reports the ids never computed, with severity ERROR (after a run with ``limit``, say, or
      new input rows). It reports the ids stored as failed, with severity WARN when those are
      the only gap.
    - ``failed_rows`` passes when no row of the partition is stored as failed. It reports their
      count, fraction and the most frequent errors with sample ids (severity WARN).

    Example::

        defs = dg.Definitions(
            assets=[tickets, ticket_routing],
            asset_checks=checkpoint_checks(ticket_routing),
            resources={"io_manager": CheckpointIOManager(base_dir="s3://bucket/checkpoints")},
        )
    """
    metadata = asset.metadata_by_key.get(asset.key, {})
    if md.ID_COLUMN not in metadata or md.SOURCE not in metadata:
        raise CheckpointError(
            f"checkpoint_checks needs an asset built with @checkpointed_asset; "
            f"{asset.key.to_user_string()} is not one.",
            "Pass the asset that @checkpointed_asset returned.",
        )
    id_column = str(md.plain(metadata[md.ID_COLUMN]))
    source_key = dg.AssetKey.from_user_string(str(md.plain(metadata[md.SOURCE])))
    partitions_def = asset.partitions_def
    source_in = {"source": dg.AssetIn(key=source_key, metadata={md.ID_COLUMN: id_column})}

    with warnings.catch_warnings():
        # Partitioned asset checks are a Dagster preview; they are what lets each shard be
        # checked on its own, so the warning is not the user's to act on.
        warnings.simplefilter("ignore", dg.PreviewWarning)

        @dg.asset_check(
            asset=asset,
            name="completeness",
            partitions_def=partitions_def,
            additional_ins=source_in,
            description="Every input id of the partition has a successful result.",
        )
        def completeness(
            context: dg.AssetCheckExecutionContext, result: pl.DataFrame, source: Any
        ) -> dg.AssetCheckResult:
            keys = _partition_keys(context, partitions_def)
            expected = _input_ids(source, id_column, keys)
            return _completeness(expected, result, id_column)

        @dg.asset_check(
            asset=asset,
            name="failed_rows",
            partitions_def=partitions_def,
            description="No row of the partition is stored as failed.",
        )
        def failed_rows(result: pl.DataFrame) -> dg.AssetCheckResult:
            return _failed_rows(result, id_column)

    return [completeness, failed_rows]


def _completeness(expected: pl.Series, result: pl.DataFrame, id_column: str) -> dg.AssetCheckResult:
    ids = expected.to_frame(id_column)
    stored = result.select(
        pl.col(id_column).cast(expected.dtype), ERROR, pl.lit(True).alias("__stored")
    )
    joined = ids.join(stored, on=id_column, how="left")
    missing = joined.filter(pl.col("__stored").is_null())
    failed = joined.filter(pl.col(ERROR).is_not_null())
    ok = ids.height - missing.height - failed.height
    return dg.AssetCheckResult(
        passed=missing.height == 0 and failed.height == 0,
        severity=dg.AssetCheckSeverity.ERROR if missing.height else dg.AssetCheckSeverity.WARN,
        metadata={
            "rows_expected": ids.height,
            "rows_ok": ok,
            "rows_failed": failed.height,
            "rows_missing": missing.height,
            "sample_missing_ids": _sample(missing, id_column),
            "sample_failed_ids": _sample(failed, id_column),
        },
        description=None
        if missing.height == 0 and failed.height == 0
        else (
            f"{missing.height:,} input row(s) have no result yet and {failed.height:,} are "
            "stored as failed. Materialize the partition again: it resumes and computes just "
            "those (failed rows while retry_failed is on)."
        ),
    )


def _failed_rows(result: pl.DataFrame, id_column: str) -> dg.AssetCheckResult:
    failed = result.filter(pl.col(ERROR).is_not_null())
    errors = (
        failed.group_by(ERROR)
        .agg(pl.len().alias("rows"), pl.col(id_column).head(SAMPLE).alias("ids"))
        .sort("rows", ERROR, descending=[True, False])
        .head(SAMPLE)
    )
    return dg.AssetCheckResult(
        passed=failed.height == 0,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "rows_failed": failed.height,
            "failed_fraction": round(failed.height / result.height, 6) if result.height else 0.0,
            "top_errors": dg.MetadataValue.md(_errors_table(errors)),
        },
        description=None
        if failed.height == 0
        else (
            f"{failed.height:,} row(s) are stored as failed. While retry_failed is on the next "
            "run of the partition (or failed_partitions_sensor) computes them again."
        ),
    )


def _errors_table(errors: pl.DataFrame) -> str:
    if errors.height == 0:
        return "No failed rows."
    lines = ["| rows | error | sample ids |", "| ---: | --- | --- |"]
    for row in errors.iter_rows(named=True):
        text = str(row[ERROR]).replace("|", "\\|").replace("\n", " ")
        if len(text) > _ERROR_CHARS:
            text = text[: _ERROR_CHARS - 3] + "..."
        ids = ", ".join(str(i) for i in row["ids"])
        lines.append(f"| {row['rows']} | {text} | {ids} |")
    return "\n".join(lines)


def _partition_keys(
    context: dg.AssetCheckExecutionContext, partitions_def: dg.PartitionsDefinition | None
) -> Sequence[str]:
    return list(context.partition_keys) if partitions_def is not None else []


def _input_ids(source: Any, id_column: str, keys: Sequence[str]) -> pl.Series:
    """The ids the asset's run of these partitions processes: the run's own rule and casts."""
    partitions: list[str | None] = list(keys) or [None]
    lazy = rows_in(as_lazy(source), id_column, partitions)
    if id_column not in lazy.collect_schema():
        validate_ids(lazy.head(0).collect(), id_column)  # says so, naming the columns there are
    rows = lazy.select(id_column).collect(engine="streaming")
    validate_ids(rows, id_column)
    rows = canonical_ids(rows, id_column)
    return rows.get_column(id_column)


def _sample(rows: pl.DataFrame, id_column: str) -> str:
    return ", ".join(str(i) for i in rows.get_column(id_column).head(SAMPLE).to_list())
