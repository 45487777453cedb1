"""Lake-scale sources: a shard's memory and reads follow the shard, not the dataset.

A lazy source streams through in batches and only the shard's rows are collected; a source stored
by ``CheckpointIOManager`` is ordered by its downstream's shard key, so a shard reads only the
row groups of its key range; a downstream annotated ``pl.LazyFrame`` gets a scan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pyarrow.parquet as pq
import pytest
from helpers.jobs import Job, Storage, build_job, ids_in_shard, route, stats, tickets
from helpers.read_counting_fs import PROTOCOL, ReadCountingFileSystem
from helpers.row_groups import groups_read, overlapping_groups

from checkpoint_assets import CheckpointIOManager, checkpointed_asset, shard_partitions
from checkpoint_assets.engine.checkpoints.parquet import watermark
from checkpoint_assets.engine.rows import CURRENT
from checkpoint_assets.engine.sharding.keyed import ROW_GROUP_ROWS

ROWS = 6 * ROW_GROUP_ROWS + 1000  # seven row groups


def guarded_scan(path: Path, allowed: set[int]) -> pl.LazyFrame:
    """A scan of ``path`` with a column the source computes row by row, which raises for any
    row outside ``allowed``: collecting more than those rows fails."""

    def guard(ids: pl.Series) -> pl.Series:
        stray = set(ids.to_list()) - allowed
        if stray:
            raise MemoryError(f"{len(stray)} rows of other shards were collected")
        return ids.str.len_chars() if ids.dtype == pl.String else ids

    checked = pl.col("ticket_id").map_batches(guard, is_elementwise=True).alias("checked")
    return pl.scan_parquet(path).with_columns(checked)


def lazy_job(tmp_path: Path, source: dict[str, Any]) -> tuple[list[dg.AssetsDefinition], Any]:
    """An upstream returning ``source["value"]`` kept in memory, and a checkpointed asset."""

    @dg.asset(name="tickets", io_manager_key="source_io")
    def upstream() -> Any:
        return source["value"]

    @checkpointed_asset(source="tickets", id_column="ticket_id", partitions_def=shard_partitions(4))
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        return route(batch)

    resources = {
        "io_manager": CheckpointIOManager(base_dir=str(tmp_path / "checkpoints")),
        "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
    }
    return [upstream, routed], resources


def test_a_lazy_source_is_computed_and_collected_for_the_shards_rows_only(
    tmp_path: Path,
) -> None:
    rows = tickets(60_000)
    rows.write_parquet(tmp_path / "tickets.parquet", row_group_size=5_000)
    mine = set(ids_in_shard(rows, 1, 4))
    lazy = guarded_scan(tmp_path / "tickets.parquet", mine)
    with pytest.raises(MemoryError, match="rows of other shards"):
        lazy.collect()  # the guard fails a collect of the whole source
    assets, resources = lazy_job(tmp_path, {"value": lazy})

    result = dg.materialize(assets, partition_key="1-of-4", resources=resources)

    computed = result.output_for_node("routed")
    assert set(computed["ticket_id"]) == mine
    assert stats(result)["rows_total"] == len(mine)


def test_a_checkpoint_written_from_an_eager_source_resumes_from_the_same_rows_read_lazily(
    tmp_path: Path,
) -> None:
    rows = tickets(3_000)
    rows.write_parquet(tmp_path / "tickets.parquet")
    source: dict[str, Any] = {"value": rows}
    assets, resources = lazy_job(tmp_path, source)
    first = dg.materialize(assets, partition_key="2-of-4", resources=resources)
    source["value"] = pl.scan_parquet(tmp_path / "tickets.parquet")

    again = dg.materialize(assets, partition_key="2-of-4", resources=resources)

    assert stats(again)["rows_computed"] == 0  # same input fingerprint, same row hashes
    assert stats(again)["rows_resumed"] == stats(first)["rows_total"]
    assert stats(first)["rows_total"] == len(ids_in_shard(rows, 2, 4))


def stored_source_job(
    base_dir: str, frame: pl.DataFrame, options: dict[str, Any] | None = None
) -> dg.JobDefinition:
    """The job of a source stored by ``CheckpointIOManager``, a checkpointed asset of 8 shards over
    it and a plain asset reading the source; the source materialized already."""

    @dg.asset(name="tickets")
    def upstream() -> pl.LazyFrame:
        return frame.lazy()

    @checkpointed_asset(source="tickets", id_column="ticket_id", partitions_def=shard_partitions(8))
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        return route(batch)

    @dg.asset(ins={"tickets": dg.AssetIn()})
    def plain(tickets: pl.DataFrame) -> pl.DataFrame:
        return tickets

    io_manager = CheckpointIOManager(base_dir=base_dir, storage_options=options or {})
    defs = dg.Definitions(assets=[upstream, routed, plain], resources={"io_manager": io_manager})
    job = defs.resolve_implicit_global_asset_job_def()
    job.execute_in_process(asset_selection=[dg.AssetKey("tickets")])
    return job


def test_a_shard_reads_only_the_row_groups_its_key_range_overlaps(tmp_path: Path) -> None:
    rows = tickets(ROWS)
    job = stored_source_job(f"{PROTOCOL}://{tmp_path}/checkpoints", rows)
    path = str(tmp_path / "checkpoints" / "tickets.parquet")
    stored = pq.read_metadata(path)
    assert stored.num_row_groups == 7
    ReadCountingFileSystem.reads.clear()

    result = job.execute_in_process(asset_selection=[dg.AssetKey("routed")], partition_key="5-of-8")

    assert sorted(result.output_for_node("routed")["ticket_id"]) == ids_in_shard(rows, 5, 8)
    wanted = overlapping_groups(path, 5, 8)
    assert 0 < len(wanted) <= 2
    assert groups_read(path) == wanted


def test_each_shard_of_a_stored_source_gets_exactly_its_rows(storage: Storage) -> None:
    rows = tickets(5_000)
    base_dir, options = storage
    job = stored_source_job(base_dir, rows, options)

    for index in (0, 7):
        key = f"{index}-of-8"
        result = job.execute_in_process(asset_selection=[dg.AssetKey("routed")], partition_key=key)

        routed = result.output_for_node("routed")
        assert sorted(routed["ticket_id"]) == ids_in_shard(rows, index, 8)
        assert stats(result)["rows_total"] == routed.height


def test_a_stored_source_reads_back_as_it_was_returned_for_other_assets(storage: Storage) -> None:
    rows = tickets(5_000)
    base_dir, options = storage
    job = stored_source_job(base_dir, rows, options)

    result = job.execute_in_process(asset_selection=[dg.AssetKey("plain")])

    read = result.output_for_node("plain")
    assert read.columns == rows.columns  # no shard key column
    assert read.sort("ticket_id").equals(rows)


def read_downstream(job: Job) -> tuple[pl.LazyFrame, pl.DataFrame, pl.DataFrame]:
    """What a downstream asset gets of ``routed``: through a ``pl.LazyFrame`` input (the frame
    itself, and collected) and through a ``pl.DataFrame`` input."""
    received: list[pl.LazyFrame] = []

    @dg.asset(ins={"routed": dg.AssetIn()})
    def lazy_report(routed: pl.LazyFrame) -> pl.DataFrame:
        received.append(routed)
        return routed.collect()

    @dg.asset(ins={"routed": dg.AssetIn()})
    def eager_report(routed: pl.DataFrame) -> pl.DataFrame:
        return routed

    lazy = job.load_downstream(lazy_report)
    return received[0], lazy, job.load_downstream(eager_report)


def test_a_lazyframe_downstream_gets_a_scan_whose_collect_equals_the_eager_result(
    storage: Storage,
) -> None:
    job = build_job(storage, tickets(400), partitions_def=shard_partitions(4))
    for key in shard_partitions(4).get_partition_keys():
        job.materialize(key)

    received, lazy, eager = read_downstream(job)

    assert "SCAN" in received.explain()  # a scan of the stored files, not a table in memory
    assert lazy.sort("ticket_id").equals(eager.sort("ticket_id"))
    assert lazy.height == 400 and lazy.columns == ["ticket_id", "route", "_error"]


def test_a_shard_with_unmerged_parts_is_read_whole_for_a_lazyframe_downstream(
    storage: Storage,
) -> None:
    job = build_job(storage, tickets(40), partitions_def=shard_partitions(2))
    job.materialize("0-of-2")
    done = job.materialize("1-of-2")
    assert done.success
    checkpoint = job.checkpoint("1-of-2")
    merged = job.store().get(checkpoint.files.merged)
    seq = watermark(merged) + 1  # the next flush of a run that stopped before finalizing
    stored = pl.read_parquet(merged).drop(CURRENT).head(3)
    checkpoint.write_part(stored.with_columns(route=pl.lit("X"), _seq=pl.lit(seq, pl.Int64)), seq)

    _, lazy, eager = read_downstream(job)

    assert lazy.sort("ticket_id").equals(eager.sort("ticket_id"))
    assert (lazy["route"] == "X").sum() == 3  # the part's rows won over the merged file's
