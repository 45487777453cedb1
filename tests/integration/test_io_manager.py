"""Loading results: downstream assets read one table, never a dict."""

from __future__ import annotations

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import Storage, build_job, run_logs, tickets

from checkpoint_assets import CheckpointError, CheckpointIOManager, shard_partitions


def test_unpartitioned_downstream_gets_all_shards_as_one_dataframe(storage: Storage) -> None:
    job = build_job(storage, tickets(40), partitions_def=shard_partitions(4))
    for key in shard_partitions(4).get_partition_keys():
        job.materialize(key)

    @dg.asset(ins={"routed": dg.AssetIn()})
    def report(routed: pl.DataFrame) -> pl.DataFrame:
        return routed

    value = job.load_downstream(report)

    assert isinstance(value, pl.DataFrame)
    assert value.columns == ["ticket_id", "route", "_error"]
    assert sorted(value["ticket_id"]) == list(range(40))
    assert value["_error"].null_count() == 40
    expected = tickets(40).select("ticket_id", route=pl.col("body").str.to_uppercase())
    assert value.sort("ticket_id").select("ticket_id", "route").equals(expected)


def test_downstream_annotated_lazyframe_gets_a_lazyframe(storage: Storage) -> None:
    job = build_job(storage, tickets(40), partitions_def=shard_partitions(4))
    for key in shard_partitions(4).get_partition_keys():
        job.materialize(key)
    received: list[object] = []

    @dg.asset(ins={"routed": dg.AssetIn()})
    def lazy_report(routed: pl.LazyFrame) -> pl.DataFrame:
        received.append(routed)
        return routed.collect()

    value = job.load_downstream(lazy_report)

    assert isinstance(received[0], pl.LazyFrame)
    assert isinstance(value, pl.DataFrame) and value.height == 40


def test_partitioned_downstream_gets_its_own_shard(storage: Storage) -> None:
    job = build_job(storage, tickets(40), partitions_def=shard_partitions(4))
    expected = job.materialize("2-of-4").output_for_node("routed")

    @dg.asset(ins={"routed": dg.AssetIn()}, partitions_def=shard_partitions(4))
    def per_shard(routed: pl.DataFrame) -> pl.DataFrame:
        return routed

    result = dg.materialize(
        [job.source, job.asset, per_shard],
        selection=[per_shard],
        partition_key="2-of-4",
        instance=job.instance,
        resources=job.resources(),
    )
    value = result.output_for_node("per_shard")
    assert isinstance(value, pl.DataFrame)
    assert sorted(value["ticket_id"]) == sorted(expected["ticket_id"])
    assert 0 < value.height < 40


def test_failed_rows_are_loaded_with_their_error(storage: Storage) -> None:
    def poison(batch: pl.DataFrame) -> pl.DataFrame:
        if 7 in batch["ticket_id"]:
            raise ValueError("row 7 is poison")
        return batch.select("ticket_id", route=pl.col("body"))

    job = build_job(storage, tickets(12), fn=poison, max_failed_fraction=0.5)

    value = job.materialize().output_for_node("routed")

    assert isinstance(value, pl.DataFrame)
    failed = value.filter(pl.col("_error").is_not_null())
    assert failed["ticket_id"].to_list() == [7]
    assert "row 7 is poison" in failed["_error"].item()
    assert failed["route"].item() is None
    assert value.height == 12


def test_ordinary_polars_assets_round_trip_through_the_io_manager(storage: Storage) -> None:
    base_dir, options = storage
    frame = tickets(5)

    @dg.asset
    def table() -> pl.DataFrame:
        return frame

    @dg.asset
    def copy(table: pl.DataFrame) -> pl.DataFrame:
        return table

    manager = CheckpointIOManager(base_dir=base_dir, storage_options=options)
    instance = dg.DagsterInstance.ephemeral()
    dg.materialize([table], instance=instance, resources={"io_manager": manager})
    result = dg.materialize(
        [table, copy], selection=[copy], instance=instance, resources={"io_manager": manager}
    )

    assert result.output_for_node("copy").equals(frame)


def test_loading_a_never_materialized_checkpoint_says_to_materialize_it(storage: Storage) -> None:
    job = build_job(storage, tickets(5))

    @dg.asset(ins={"routed": dg.AssetIn()})
    def report(routed: pl.DataFrame) -> pl.DataFrame:
        return routed

    with pytest.raises(CheckpointError, match="Materialize it first"):
        job.load_downstream(report)


def test_downstream_after_a_checkpointing_false_run_is_told_what_it_loads(
    storage: Storage,
) -> None:
    job = build_job(storage, tickets(20))
    job.materialize()
    job.set_input(tickets(30))
    job.materialize(checkpointing=False)  # computes 30 rows, stores none of them

    @dg.asset
    def report(routed: pl.DataFrame) -> pl.DataFrame:
        return routed

    result = dg.materialize(
        [job.source, job.asset, report],
        selection=[report],
        instance=job.instance,
        resources=job.resources(),
    )

    assert result.output_for_node("report").height == 20  # what earlier runs stored
    warnings = [m for m in run_logs(result, job.instance) if "checkpointing: false" in m]
    assert warnings and "earlier runs stored" in warnings[0]


def test_a_checkpointed_asset_with_another_io_manager_says_how_to_bind_one(
    storage: Storage,
) -> None:
    job = build_job(storage, tickets(4))

    with pytest.raises(CheckpointError, match="must be a CheckpointIOManager, not InMemory") as e:
        dg.materialize(
            [job.source, job.asset],
            resources={"io_manager": dg.InMemoryIOManager(), "source_io": dg.InMemoryIOManager()},  # type: ignore[no-untyped-call]
            instance=job.instance,
        )

    assert "Bind that key to CheckpointIOManager" in str(e.value)
    assert job.calls == []
