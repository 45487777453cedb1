"""``global_resume_asset``: reconcile finished rows across every shard scheme of an asset.

The built asset reads storage directly. It depends on the checkpointed asset for lineage only,
so it can be materialized before any shard of a new scheme exists. It builds one table per
checkpoint tag, since tags never mix: ``<asset>_global_resume/<tag>.parquet``. That is where the
IO manager would store a partition ``<tag>`` of it. The table is streamed in the keyed layout of
the id column, so a shard's lookup reads only the row groups of its key range. A shard run with
``global_resume: true`` takes the finished rows for its ids from its own tag's table. Those are
rows with the same id, input hash and job. It copies them into its checkpoint and skips them.
"""

from collections.abc import Sequence
from typing import Any

import dagster as dg
import polars as pl
from pydantic import Field

from checkpoint_assets.engine.checkpoints.layout import DEFAULT_TAG, asset_folder
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.plan.global_resume import JOB, Found, shard_rows, tags, write_table
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.scheme import Shard, rows_in
from checkpoint_assets.engine.storage import Store
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.store.io_manager import (
    CheckpointIOManager,
    checkpoint_io_manager,
)
from checkpoint_assets.integration.store.source import scan, without_shard_keys


class GlobalResumeConfig(dg.Config):
    """Which checkpoints to reconcile."""

    checkpoint_tag: str | None = Field(
        default=None,
        description="Build only this tag's table (default: one table per tag found in storage).",
    )


def table_path(
    io_manager: CheckpointIOManager, store: Store, asset_key: dg.AssetKey, tag: str | None
) -> str:
    """Where the global resume table of ``asset_key``'s checkpoints of ``tag`` is stored."""
    return io_manager.output_path(store, global_resume_key(asset_key), tag or DEFAULT_TAG)


def global_resume_key(asset_key: dg.AssetKey) -> dg.AssetKey:
    """The key of the global resume asset of ``asset_key``: ``<asset>_global_resume``."""
    return dg.AssetKey([*asset_key.path[:-1], f"{asset_key.path[-1]}_global_resume"])


def global_resume_asset(
    asset: dg.AssetsDefinition,
    *,
    io_manager_key: str = "io_manager",
    group_name: str | None = None,
) -> dg.AssetsDefinition:
    """An unpartitioned asset holding the finished rows of every checkpoint of ``asset``.

    One table per checkpoint tag found in storage (run config ``checkpoint_tag``: that tag's
    only), each from that tag's checkpoints alone.

    Example: after changing ``shard_partitions(8)`` to ``shard_partitions(16)``, materialize
    ``ticket_routing_global_resume``, then backfill ``ticket_routing`` with run config
    ``{"global_resume": true}``: nothing finished is computed again.
    """
    key = asset.key
    metadata = asset.metadata_by_key.get(key, {})
    if md.ID_COLUMN not in metadata:
        raise CheckpointError(
            f"global_resume_asset needs an asset built with @checkpointed_asset; "
            f"{key.to_user_string()} is not one.",
            "Pass the asset that @checkpointed_asset returned.",
        )
    id_column = str(md.plain(metadata[md.ID_COLUMN]))

    @dg.asset(
        key=global_resume_key(key),
        deps=[key],
        io_manager_key=io_manager_key,
        group_name=group_name or asset.group_names_by_key.get(key),
        metadata={md.GLOBAL_RESUME_OF: key.to_user_string()},
        description=(
            f"Finished rows of every checkpoint of {key.to_user_string()}, of every shard "
            "scheme on storage, one table per checkpoint tag, for runs with "
            "`global_resume: true`."
        ),
        kinds={"polars"},
    )
    def _global_resume(
        context: dg.AssetExecutionContext, config: GlobalResumeConfig
    ) -> dg.MaterializeResult:
        return _build_tables(context, config, io_manager_key, key, id_column)

    return _global_resume


def _build_tables(
    context: dg.AssetExecutionContext,
    config: GlobalResumeConfig,
    io_manager_key: str,
    key: dg.AssetKey,
    id_column: str,
) -> dg.MaterializeResult:
    """Write the global resume table of each tag of ``key``'s checkpoints (the asset's body)."""
    io_manager = checkpoint_io_manager(context, io_manager_key)
    store = io_manager.store()
    built = [config.checkpoint_tag] if config.checkpoint_tag else tags(store, key.path)
    found, rows = Found(), 0
    for tag in built:  # one table in memory at a time
        with store.put_file(table_path(io_manager, store, key, tag)) as local:
            height, read = write_table(store, asset_folder(key.path, tag), id_column, local)
        context.log.info(
            "Tag %r: reconciled %d finished rows from %d checkpoints (%s).",
            tag,
            height,
            len(read.checkpoints),
            ", ".join(sorted(set(read.schemes))) or "none found",
        )
        found.checkpoints += read.checkpoints
        found.schemes += read.schemes
        found.rows_read += read.rows_read
        rows += height
    details: dict[str, Any] = {
        "tags": built,
        "checkpoints": len(found.checkpoints),
        "schemes": sorted(set(found.schemes)),
        "rows_read": found.rows_read,
        "rows_finished": rows,
    }
    return dg.MaterializeResult(metadata=details)


def global_rows(
    io_manager: CheckpointIOManager,
    store: Store,
    context: dg.AssetExecutionContext,
    job: dict[str, Any],
    keys: Sequence[str | None],
    tag: str | None,
) -> pl.DataFrame:
    """Finished rows of this job from other checkpoints, for the shards ``keys``.

    Range shards read only the overlapping checkpoints of earlier shard counts. Storage may hold
    checkpoints that cannot be narrowed down (unpartitioned, other partition keys, the mod rule).
    Then the rows come from the asset's global resume table of the run's tag.
    """
    asset_key = context.asset_key
    fingerprint = hashing.job_fingerprint(job)
    shards = [Shard.parse(k) for k in keys if k is not None]
    if shards and len(shards) == len(keys) and all(shards):
        folder = asset_folder(asset_key.path, tag or DEFAULT_TAG)
        ranged = [s for s in shards if s is not None]
        found = shard_rows(store, folder, job["id_column"], fingerprint, ranged)
        if found is not None:
            table, read = found
            context.log.info(
                "Global resume: %d finished row(s) of these shards in %d overlapping "
                "checkpoint(s) of earlier shard counts (%s).",
                table.height,
                len(read.checkpoints),
                ", ".join(sorted(set(read.schemes))) or "none found",
            )
            return table
    key = global_resume_key(asset_key)
    path = table_path(io_manager, store, asset_key, tag)  # this tag's: tags never mix
    if not store.exists(path):
        raise CheckpointError(
            f"`global_resume: true` needs the table of {key.to_user_string()} for checkpoint "
            f"tag {tag or DEFAULT_TAG!r} at {store.display(path)}, which does not exist (storage "
            "holds checkpoints that are not range shards: unpartitioned, other partition keys, "
            "or shards written by the earlier mod rule).",
            f"Add global_resume_asset({asset_key.path[-1]}) to your Definitions and materialize "
            "it first (it builds a table for every tag on storage).",
        )
    stored = scan(store, path)
    if JOB not in stored.collect_schema():
        return pl.DataFrame()  # no finished rows anywhere
    # Stored in the keyed layout: the shards' filter reads only their row groups.
    mine = rows_in(stored, job["id_column"], keys).filter(pl.col(JOB) == fingerprint).drop(JOB)
    return without_shard_keys(mine).collect(engine="streaming")
