"""The keyed layout of a stored source on the ``dg.materialize`` path, and the log line where no
checkpointed asset that reads the source can be seen."""

from __future__ import annotations

import itertools
from pathlib import Path

import dagster as dg
import polars as pl
import pyarrow.parquet as pq

from checkpoint_assets import CheckpointIOManager, checkpointed_asset, shard_partitions


def test_materializing_the_source_alone_beside_its_checkpointed_asset_stores_it_keyed(
    tmp_path: Path,
) -> None:
    @dg.asset(name="layout_tickets")
    def tickets() -> pl.DataFrame:
        return pl.DataFrame({"ticket_id": range(50_000), "body": [f"b{i}" for i in range(50_000)]})

    @checkpointed_asset(
        source="layout_tickets", id_column="ticket_id", partitions_def=shard_partitions(4)
    )
    def layout_routed(batch: pl.DataFrame) -> pl.DataFrame:
        return batch.select("ticket_id", route=pl.col("body"))

    resources = {"io_manager": CheckpointIOManager(base_dir=str(tmp_path))}
    dg.materialize([tickets, layout_routed], selection=[tickets], resources=resources)

    stored = pq.ParquetFile(tmp_path / "layout_tickets.parquet")
    names = stored.schema_arrow.names
    assert names == ["_source_row", "ticket_id", "body", "_shard_key:ticket_id"]
    key = names.index("_shard_key:ticket_id")
    groups = [stored.metadata.row_group(g).column(key).statistics for g in range(4)]
    # Ordered by the shard key: each row group holds a range of keys after the one before.
    assert all(a.max <= b.min for a, b in itertools.pairwise(groups))


def test_a_source_no_checkpointed_asset_reads_is_stored_as_it_is_and_the_log_says_so(
    tmp_path: Path,
) -> None:
    @dg.asset(name="layout_plain")
    def plain() -> pl.DataFrame:
        return pl.DataFrame({"ticket_id": range(10)})

    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [plain],
            instance=instance,
            resources={"io_manager": CheckpointIOManager(base_dir=str(tmp_path))},
        )
        logs = [e.user_message for e in instance.all_logs(result.run_id)]

    assert pq.ParquetFile(tmp_path / "layout_plain.parquet").schema_arrow.names == ["ticket_id"]
    said = [m for m in logs if "layout_plain is stored as it is, not keyed by shard" in m]
    assert said and "each of its shards reads the whole file" in said[0]


def test_a_stored_source_with_a_duplicated_id_fails_every_shard_before_any_computes(
    tmp_path: Path,
) -> None:
    @dg.asset(name="layout_dup_tickets")
    def tickets() -> pl.DataFrame:
        ids = [*range(400), 123]  # 123 twice
        return pl.DataFrame({"ticket_id": ids, "body": [f"b{i}" for i in ids]})

    calls: list[int] = []

    @checkpointed_asset(
        source="layout_dup_tickets",
        id_column="ticket_id",
        partitions_def=shard_partitions(4),
        backfill_policy=dg.BackfillPolicy.single_run(),
    )
    def layout_dup_routed(batch: pl.DataFrame) -> pl.DataFrame:
        calls.append(batch.height)
        return batch.select("ticket_id", route=pl.col("body"))

    resources = {"io_manager": CheckpointIOManager(base_dir=str(tmp_path))}
    with dg.instance_for_test() as instance:
        dg.materialize([tickets], instance=instance, resources=resources)
        ranged = dg.materialize(
            [tickets, layout_dup_routed],
            selection=[layout_dup_routed],
            instance=instance,
            resources=resources,
            tags={
                "dagster/asset_partition_range_start": "0-of-4",
                "dagster/asset_partition_range_end": "3-of-4",
            },
            raise_on_error=False,
        )
        materialized = instance.get_materialized_partitions(layout_dup_routed.key)

    assert not ranged.success and materialized == set() and calls == []
    error = ranged.get_step_failure_events()[0].step_failure_data.error
    assert error is not None
    message = error.cause.message if error.cause else error.message
    assert "1 duplicated value(s) (123 at rows [123, 400]" in message
