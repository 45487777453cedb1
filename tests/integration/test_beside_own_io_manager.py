"""The README's "Use it in your project": the team's own IO manager stays the default, and
``CheckpointIOManager`` stores the checkpointed asset under a key of its own
(``io_manager_key``)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import polars as pl
from helpers.jobs import route, tickets

from checkpoint_assets import CheckpointIOManager, checkpointed_asset, shard_partitions


def test_the_teams_io_manager_keeps_every_other_asset(tmp_path: Path) -> None:
    @dg.asset(name="tickets")
    def source() -> pl.DataFrame:
        return tickets(40)

    @checkpointed_asset(
        source="tickets",
        id_column="ticket_id",
        partitions_def=shard_partitions(2),
        io_manager_key="checkpoints",
    )
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        return route(batch)

    @dg.asset
    def report(routed: pl.DataFrame) -> int:
        return routed.height

    own = tmp_path / "own"
    checkpoints = tmp_path / "checkpoints"
    resources = {
        "io_manager": dg.FilesystemIOManager(base_dir=str(own)),
        "checkpoints": CheckpointIOManager(base_dir=str(checkpoints)),
    }
    instance = dg.DagsterInstance.ephemeral()
    assert dg.materialize([source], resources=resources, instance=instance).success
    for shard in shard_partitions(2).get_partition_keys():
        result = dg.materialize(
            [source, routed],
            selection="routed",
            partition_key=shard,
            resources=resources,
            instance=instance,
        )
        assert result.success
    summary = dg.materialize(
        [source, routed, report], selection="report", resources=resources, instance=instance
    )

    assert summary.output_for_node("report") == 40  # every shard, read through its own key
    # The source and the report are the team's (pickles); the shards are checkpoints.
    assert sorted(p.name for p in own.iterdir()) == ["report", "tickets"]
    assert sorted(p.name for p in (checkpoints / "routed").rglob("*.parquet")) == [
        "0-of-2.parquet",
        "1-of-2.parquet",
    ]
