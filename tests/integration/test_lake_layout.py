"""Lake-scale layouts: a stored source larger than the write buffer, partitioned upstreams, the
global resume table and ranged runs, each shard reading only its slice.

The write buffer (``keyed.BUFFER_BYTES``) is made small here, so that tables of a few thousand
rows take the path of tables larger than memory: spilled to bucket files, sorted a bucket at a
time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import ids_in_shard, route, tickets
from helpers.read_counting_fs import PROTOCOL, ReadCountingFileSystem
from helpers.row_groups import groups_in, groups_read, overlapping_groups

from checkpoint_assets import (
    CheckpointIOManager,
    checkpointed_asset,
    global_resume_asset,
    shard_partitions,
)
from checkpoint_assets.engine.sharding import keyed
from checkpoint_assets.engine.sharding.hashing import shard_of

ROWS = 40_000
DAYS = ["day1", "day2", "day3"]


@pytest.fixture(autouse=True)
def small_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keyed, "BUFFER_BYTES", 64 * 1024)


def run(
    assets: list[dg.AssetsDefinition],
    resources: dict[str, Any],
    name: str,
    partition: str | None = None,
    **kwargs: Any,
) -> dg.ExecuteInProcessResult:
    """Materialize ``name`` through the Definitions' job, whose graph shows the IO manager the
    checkpointed assets downstream of a source (as a run from the UI or the daemon does)."""
    job = dg.Definitions(assets=assets, resources=resources).resolve_implicit_global_asset_job_def()
    return job.execute_in_process(
        asset_selection=[dg.AssetKey(name)], partition_key=partition, **kwargs
    )


def metadata(result: dg.ExecuteInProcessResult, node: str) -> dict[str, Any]:
    (event,) = result.asset_materializations_for_node(node)
    return {k: v.value for k, v in event.metadata.items()}


def routed(count: int, **kwargs: Any) -> dg.AssetsDefinition:
    @checkpointed_asset(
        source="tickets",
        id_column="ticket_id",
        name=f"routed{count}",
        partitions_def=shard_partitions(count),
        checkpoint_interval=100_000,
        **kwargs,
    )
    def asset(batch: pl.DataFrame) -> pl.DataFrame:
        return route(batch)

    return asset


def test_a_source_past_the_write_buffer_is_stored_keyed_and_shards_of_any_count_read_their_groups(
    tmp_path: Path,
) -> None:
    rows = tickets(ROWS)

    @dg.asset(name="tickets")
    def upstream() -> pl.LazyFrame:
        return rows.lazy()

    assets = [upstream, routed(3), routed(48)]
    resources = {"io_manager": CheckpointIOManager(base_dir=f"{PROTOCOL}://{tmp_path}")}
    run(assets, resources, "tickets")
    path = str(tmp_path / "tickets.parquet")

    for count, index in ((3, 1), (48, 17), (48, 47)):
        ReadCountingFileSystem.reads.pop(path, None)
        name = f"routed{count}"
        key = shard_partitions(count).get_partition_keys()[index]
        result = run(assets, resources, name, key)

        assert sorted(result.output_for_node(name)["ticket_id"]) == ids_in_shard(rows, index, count)
        assert groups_read(path) == overlapping_groups(path, index, count)
    assert len(overlapping_groups(path, 17, 48)) < len(overlapping_groups(path, 1, 3))


def partitioned(tmp_path: Path, days: list[str]) -> tuple[list[dg.AssetsDefinition], Any]:
    """A source written a day at a time, its days in ``days`` order, and 4 shards over all."""
    rows = tickets(3 * ROWS // 4)

    @dg.asset(name="tickets", partitions_def=dg.StaticPartitionsDefinition(days))
    def upstream(context) -> pl.LazyFrame:  # type: ignore[no-untyped-def]
        day = DAYS.index(context.partition_key)
        return rows.lazy().filter(pl.col("ticket_id") % 3 == day)

    checkpointed = routed(4, source_partition_mapping=dg.AllPartitionMapping())
    resources = {"io_manager": CheckpointIOManager(base_dir=f"{PROTOCOL}://{tmp_path}")}
    for day in days:  # each partition by its own run
        run([upstream, checkpointed], resources, "tickets", day)
    return [upstream, checkpointed], resources


def test_shards_over_every_partition_of_a_partitioned_source_read_their_slice_of_each(
    tmp_path: Path,
) -> None:
    assets, resources = partitioned(tmp_path, DAYS)
    files = [str(tmp_path / "tickets" / f"{day}.parquet") for day in DAYS]
    for file in files:
        ReadCountingFileSystem.reads.pop(file, None)

    result = run(assets, resources, "routed4", "2-of-4")

    everything = tickets(3 * ROWS // 4)
    assert sorted(result.output_for_node("routed4")["ticket_id"]) == ids_in_shard(everything, 2, 4)
    for file in files:
        assert groups_read(file) == overlapping_groups(file, 2, 4)

    again_assets, _ = partitioned(tmp_path, list(reversed(DAYS)))  # read in another order
    again = run(again_assets, resources, "routed4", "2-of-4")

    assert metadata(again, "routed4")["rows_computed"] == 0
    assert (
        metadata(again, "routed4")["input_fingerprint"]
        == (metadata(result, "routed4")["input_fingerprint"])
    )


def test_a_shards_global_resume_lookup_reads_only_its_row_groups_of_the_table(
    tmp_path: Path,
) -> None:
    rows = tickets(ROWS)

    @dg.asset(name="tickets")
    def upstream() -> pl.DataFrame:
        return rows

    def version(partitions_def: dg.PartitionsDefinition | None) -> dg.AssetsDefinition:
        @checkpointed_asset(
            source="tickets",
            id_column="ticket_id",
            name="routing",
            partitions_def=partitions_def,
            checkpoint_interval=100_000,
        )
        def routing(batch: pl.DataFrame) -> pl.DataFrame:
            return route(batch)

        return routing

    resources = {"io_manager": CheckpointIOManager(base_dir=f"{PROTOCOL}://{tmp_path}")}
    whole = version(None)  # an unpartitioned checkpoint: only the table can narrow it down
    run([upstream, whole], resources, "tickets")
    run([upstream, whole], resources, "routing")
    sharded = version(shard_partitions(8))
    table = global_resume_asset(sharded)
    built = run([upstream, sharded, table], resources, "routing_global_resume")
    assert metadata(built, "routing_global_resume")["rows_finished"] == ROWS
    path = str(tmp_path / "routing_global_resume" / "default.parquet")
    ReadCountingFileSystem.reads.pop(path, None)

    config = {"ops": {"routing": {"config": {"global_resume": True}}}}
    result = run([upstream, sharded], resources, "routing", "5-of-8", run_config=config)

    done = metadata(result, "routing")
    assert done["rows_computed"] == 0 and done["rows_resumed"] == len(ids_in_shard(rows, 5, 8))
    assert 0 < len(groups_read(path)) < len(overlapping_groups(path, 0, 1)) / 4
    assert groups_read(path) == overlapping_groups(path, 5, 8)


def test_a_ranged_run_reads_its_source_once_and_gives_each_shard_exactly_its_rows(
    tmp_path: Path,
) -> None:
    rows = tickets(ROWS)
    seen: list[int] = []

    def count(ids: pl.Series) -> pl.Series:
        seen.append(ids.len())
        return ids

    @dg.asset(name="tickets", io_manager_key="source_io")
    def upstream() -> pl.LazyFrame:  # computed, not stored: no key column to read by
        seen_ids = pl.col("ticket_id").map_batches(count, return_dtype=pl.Int64)
        return rows.lazy().with_columns(seen_ids.alias("seen"))

    checkpointed = routed(4, backfill_policy=dg.BackfillPolicy.multi_run(3))
    io_manager = CheckpointIOManager(base_dir=str(tmp_path))
    resources = {"io_manager": io_manager, "source_io": dg.InMemoryIOManager()}  # type: ignore[no-untyped-call]
    job = dg.Definitions(assets=[upstream, checkpointed], resources=resources)
    tags = {
        "dagster/asset_partition_range_start": "0-of-4",
        "dagster/asset_partition_range_end": "2-of-4",
    }

    result = job.resolve_implicit_global_asset_job_def().execute_in_process(
        asset_selection=[dg.AssetKey("tickets"), dg.AssetKey("routed4")], tags=tags
    )

    assert result.success
    assert sum(seen) <= ROWS  # every source row computed at most once for three shards
    for index in range(3):
        key = f"{index}-of-4"
        stored = io_manager.checkpoint(dg.AssetKey("routed4"), None, key).load("ticket_id").rows
        assert sorted(stored["ticket_id"]) == ids_in_shard(rows, index, 4)


def test_a_ranged_run_reads_each_shards_rows_only_once_the_shard_before_is_checkpointed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keyed, "ROW_GROUP_ROWS", 1024)  # about 10 row groups a shard of 4
    rows = tickets(ROWS)
    events: list[tuple[str, int]] = []  # ("call", shard) and ("read", shard), in order
    stored: list[bool] = []  # at each read: was the shard before it stored?
    io_manager = CheckpointIOManager(base_dir=f"{PROTOCOL}://{tmp_path}")
    source = str(tmp_path / "tickets.parquet")

    def merged(index: int) -> str:
        checkpoint = io_manager.checkpoint(dg.AssetKey("routed4"), None, f"{index}-of-4")
        return checkpoint.files.merged

    @dg.asset(name="tickets")
    def upstream() -> pl.DataFrame:
        return rows

    @checkpointed_asset(
        source="tickets",
        id_column="ticket_id",
        name="routed4",
        partitions_def=shard_partitions(4),
        backfill_policy=dg.BackfillPolicy.multi_run(3),
    )
    def routed4(batch: pl.DataFrame) -> pl.DataFrame:
        (shard,) = set(shard_of(batch.get_column("ticket_id"), 4).tolist())
        events.append(("call", int(shard)))
        return route(batch)

    assets = [upstream, routed4]
    run(assets, {"io_manager": io_manager}, "tickets")
    own = [overlapping_groups(source, i, 4) for i in range(4)]
    only = [own[i] - set().union(*(own[:i] + own[i + 1 :])) for i in range(4)]
    record = ReadCountingFileSystem.record.__func__  # type: ignore[attr-defined]

    def recording(cls: type, path: str, start: int, length: int) -> None:
        record(cls, path, start, length)
        if path == source:
            for index, groups in enumerate(only):
                if groups & groups_in(source, start, length):
                    events.append(("read", index))
                    stored.append(index == 0 or os.path.exists(merged(index - 1)))

    monkeypatch.setattr(ReadCountingFileSystem, "record", classmethod(recording))
    tags = {
        "dagster/asset_partition_range_start": "0-of-4",
        "dagster/asset_partition_range_end": "2-of-4",
    }

    assert run(assets, {"io_manager": io_manager}, "routed4", tags=tags).success

    # Shard by shard: each one's row groups read after every call of the one before.
    order = [shard for _, shard in events]
    assert sorted(set(order)) == [0, 1, 2]
    for index in (1, 2):
        first_read = events.index(("read", index))
        last_call = len(events) - 1 - events[::-1].index(("call", index - 1))
        assert last_call < first_read, events
    assert all(stored)
