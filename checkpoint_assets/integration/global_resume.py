"""``global_resume_asset``: reconcile finished rows across every shard scheme of an asset.

The built asset reads storage directly and depends on the checkpointed asset for lineage only,
so it can be materialized before any shard of a new scheme exists. A shard run with
``global_resume: true`` then takes the finished rows for its ids (same id, same input hash, same
job) from its table into its own checkpoint and skips them.
"""

from typing import Any

import dagster as dg
import polars as pl
from pydantic import Field

from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.global_resume import finished_rows
from checkpoint_assets.engine.layout import DEFAULT_TAG, asset_folder
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.io_manager import checkpoint_io_manager


class GlobalResumeConfig(dg.Config):
    """Which checkpoints to reconcile."""

    checkpoint_tag: str | None = Field(
        default=None, description="Reconcile the checkpoints of this tag (default: 'default')."
    )


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
            "scheme on storage, for runs with `global_resume: true`."
        ),
        kinds={"polars"},
    )
    def _global_resume(
        context: dg.AssetExecutionContext, config: GlobalResumeConfig
    ) -> pl.DataFrame:
        store = checkpoint_io_manager(context, io_manager_key).store()
        folder = asset_folder(key.path, config.checkpoint_tag or DEFAULT_TAG)
        table, found = finished_rows(store, folder, id_column)
        details: dict[str, Any] = {
            "checkpoints": len(found.checkpoints),
            "schemes": sorted(set(found.schemes)),
            "rows_read": found.rows_read,
            "rows_finished": table.height,
        }
        context.add_output_metadata(details)
        context.log.info(
            "Reconciled %d finished rows from %d checkpoints (%s).",
            table.height,
            len(found.checkpoints),
            ", ".join(sorted(set(found.schemes))) or "none found",
        )
        return table

    return _global_resume
