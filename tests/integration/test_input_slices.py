"""A shard's input is read a slice at a time as its calls need it, never collected whole.

The source is stored on a filesystem that records every byte range read
(``helpers/read_counting_fs.py``), in row groups of ``ROW_GROUP_ROWS`` rows. A run reads
its shard twice, the same key ranges each time: once to hash every row, then again as the calls
take the rows (from a local copy of the first read, for a source off local disk: the first test
reads the source again, so its reads show). So a row group read twice as often by the end as at
some call was read by the second read before that call. The function records, at each call,
which row groups the second read had reached: never more than the slice its rows come from.
A provider-batch shard's ``request()`` records the same as each submission takes its rows.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pyarrow.parquet as pq
import pytest
from helpers.read_counting_fs import PROTOCOL, ReadCountingFileSystem
from helpers.row_groups import groups_in

from checkpoint_assets import (
    CheckpointIOManager,
    OpenAIResource,
    checkpointed_asset,
    provider_batch_asset,
    shard_partitions,
)
from checkpoint_assets.engine.plan import inputs
from checkpoint_assets.engine.providers.submissions import Limits
from checkpoint_assets.engine.sharding import hashing, keyed
from checkpoint_assets.engine.sharding.scheme import shard_key_column
from checkpoint_assets.integration.run import asset_run as asset_module
from checkpoint_assets.integration.store import source
from checkpoint_assets.integration.store.source import ShardRows
from checkpoint_assets.resources.openai_batches import OpenAIBatches
from examples.llm_batch.jobs import Settings
from examples.llm_batch.provider import serve
from examples.llm_batch.provider import stats as provider_stats

# The slice and the row group a quarter of the package's (``inputs.SLICE_ROWS``,
# ``keyed.ROW_GROUP_ROWS``), in the same ratio, so the rows are a quarter too: the same reads, at
# a quarter of the work. (Smaller row groups than this are read several to a request.)
SLICE_ROWS = inputs.SLICE_ROWS // 4
ROW_GROUP_ROWS = keyed.ROW_GROUP_ROWS // 4
ROWS = 60_000  # one shard of 2: about 7 row groups, 4 slices
BATCH = 1_000
BODY = "body"


@pytest.fixture(autouse=True)
def _small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inputs, "SLICE_ROWS", SLICE_ROWS)
    monkeypatch.setattr(source, "SLICE_ROWS", SLICE_ROWS)
    monkeypatch.setattr(keyed, "ROW_GROUP_ROWS", ROW_GROUP_ROWS)


def _body_reads(path: str) -> Counter[int]:
    """How many times each row group's ``body`` column chunk was read so far."""
    meta = pq.read_metadata(path)
    column = meta.schema.names.index(BODY)
    chunks = {
        g: (
            meta.row_group(g).column(column).dictionary_page_offset
            or meta.row_group(g).column(column).data_page_offset,
            meta.row_group(g).column(column).total_compressed_size,
        )
        for g in range(meta.num_row_groups)
    }
    counts: Counter[int] = Counter()
    for offset, length in list(ReadCountingFileSystem.reads.get(path, [])):
        for g in groups_in(path, offset, length):
            start, size = chunks[g]
            if offset < start + size and offset + length > start:
                counts[g] += 1
    return counts


def _group_of(path: str, keys: pl.Series) -> int:
    """The last row group holding any of the shard ``keys``."""
    meta = pq.read_metadata(path)
    column = meta.schema.names.index(shard_key_column("ticket_id"))
    top = keys.max()
    assert isinstance(top, int)
    return max(
        g
        for g in range(meta.num_row_groups)
        if meta.row_group(g).column(column).statistics.min <= top
    )


class _Refetching(ShardRows):
    """``ShardRows`` reading a source off local disk again instead of keeping a local copy of
    what it fetched: the second read then shows in the store's byte ranges."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "remote": False})


Seen = list[tuple[int, Counter[int]]]  # at each call: its rows' last row group, reads so far


def _upstream() -> dg.AssetsDefinition:
    @dg.asset(name="tickets")
    def upstream() -> pl.DataFrame:
        ids = range(ROWS)
        return pl.DataFrame({"ticket_id": ids, BODY: [f"ticket {i} " * 8 for i in ids]})

    return upstream


def _run_shard(tmp_path: Path) -> tuple[Seen, Counter[int], int]:
    """Shard 1 of 2 over a stored source: at each call, its rows' last row group and the reads
    of each group so far; the reads at the end; the rows of the shard."""
    path = str(tmp_path / "tickets.parquet")
    seen: Seen = []

    @checkpointed_asset(
        source="tickets",
        id_column="ticket_id",
        input_columns=[BODY],
        partitions_def=shard_partitions(2),
        batch_size=BATCH,
        checkpoint_interval=12_500,
    )
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        keys = batch.select(hashing.shard_key("ticket_id", pl.Int64)).to_series()
        seen.append((_group_of(path, keys), _body_reads(path)))
        return batch.select("ticket_id", length=pl.col(BODY).str.len_bytes())

    rows = _materialize(tmp_path, routed, {})
    assert len(seen) == -(-rows // BATCH)  # every row called once
    return seen, _body_reads(path), rows


def _materialize(tmp_path: Path, routed: dg.AssetsDefinition, resources: dict[str, Any]) -> int:
    """Store the source, then run shard 1 of 2 of ``routed``; its rows."""
    path = str(tmp_path / "tickets.parquet")
    io_manager = CheckpointIOManager(base_dir=f"{PROTOCOL}://{tmp_path}")
    definitions = dg.Definitions(
        assets=[_upstream(), routed], resources={"io_manager": io_manager, **resources}
    )
    job = definitions.resolve_implicit_global_asset_job_def()
    assert job.execute_in_process(asset_selection=[dg.AssetKey("tickets")]).success
    ReadCountingFileSystem.reads.pop(path, None)

    result = job.execute_in_process(asset_selection=[routed.key], partition_key="1-of-2")

    assert result.success
    rows = result.asset_materializations_for_node(routed.key.path[-1])[0].metadata["rows_total"]
    assert isinstance(rows.value, int) and rows.value > 3 * SLICE_ROWS  # several slices
    return rows.value


def _read_as_called(seen: Seen, final: Counter[int]) -> None:
    """Every row group read twice (the same key ranges each time), and at each call the second
    read at most a slice ahead of the rows being called."""
    shard_groups = sorted(final)
    assert len(shard_groups) > 3 * SLICE_ROWS // ROW_GROUP_ROWS
    assert all(final[g] % 2 == 0 for g in shard_groups)  # two reads of the same ranges
    for group, reads in seen:
        by_second_read = [g for g in shard_groups if reads[g] > final[g] // 2]
        # A slice of SLICE_ROWS rows overlaps at most 1 + SLICE_ROWS / ROW_GROUP_ROWS groups.
        assert max(by_second_read) <= group + 1 + SLICE_ROWS // ROW_GROUP_ROWS, (group, reads)
    first_reads = seen[0][1]
    assert [g for g in shard_groups if first_reads[g] > final[g] // 2] != shard_groups


def test_a_shard_reads_its_input_a_slice_at_a_time_as_its_calls_need_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(asset_module, "ShardRows", _Refetching)

    seen, final, _ = _run_shard(tmp_path)

    _read_as_called(seen, final)


class _SmallBatches(OpenAIResource):
    """``OpenAIResource`` whose batches hold at most ``SUBMISSION`` requests each."""

    def batch_provider(self, endpoint: str | None = None) -> OpenAIBatches:
        api = super().batch_provider(endpoint)
        api.limits = Limits(SUBMISSION, api.limits.max_bytes)
        return api


SUBMISSION = 5_000  # requests in one provider batch: a shard of 1-of-2 sends 6


def test_a_provider_batch_shard_reads_its_input_a_slice_at_a_time_as_it_submits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its requests are built as each submission takes its rows (through the local provider's
    OpenAI Batch API): the reader is at most a slice ahead of the row being turned into a
    request, and every row is submitted and stored once."""
    monkeypatch.setattr(asset_module, "ShardRows", _Refetching)
    path = str(tmp_path / "tickets.parquet")
    seen: Seen = []

    def parse(body: dict[str, Any]) -> dict[str, Any]:
        return {"answer": body["choices"][0]["message"]["content"]}

    @provider_batch_asset(
        source="tickets",
        id_column="ticket_id",
        input_columns=[BODY],
        partitions_def=shard_partitions(2),
        parse=parse,
        poll_seconds=0.05,
        max_poll_seconds=0.2,
    )
    def routed(row: dict[str, Any]) -> dict[str, Any]:
        if row["ticket_id"] % 97 == 0:  # a sample: reading the reads takes a while
            key = pl.Series([row["ticket_id"]]).to_frame("ticket_id")
            keys = key.select(hashing.shard_key("ticket_id", pl.Int64)).to_series()
            seen.append((_group_of(path, keys), _body_reads(path)))
        return {"messages": [{"role": "user", "content": row[BODY]}]}

    with serve(Settings()) as url:
        resource = _SmallBatches(base_url=url, api_key="local", model="m")
        rows = _materialize(tmp_path, routed, {"openai": resource})
        provider = provider_stats(url)

    assert provider["creates"] == -(-rows // SUBMISSION)
    assert provider["submitted"] == provider["succeeded"] == rows  # each row paid once
    _read_as_called(seen, _body_reads(path))


def test_a_shard_fetches_a_source_off_local_disk_once(tmp_path: Path) -> None:
    """Its first read keeps each slice in a local file, which the calls read again."""
    seen, final, _ = _run_shard(tmp_path)

    # Each row group once, or twice at the edge of two slices.
    assert final and all(final[g] <= 2 for g in final)
    assert sum(final.values()) < 1.5 * len(final)
    assert all(reads == final for _, reads in seen)  # all fetched before the first call


@pytest.mark.parametrize("shards", [None, 2])
def test_a_source_stored_elsewhere_is_read_back_from_local_files(
    tmp_path: Path, shards: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LazyFrame source that another IO manager keeps, sharded or not: each shard's rows
    stream once into a local file (the buffer is made small, so they do not stay in memory),
    read back a slice at a time; every row is computed once, with its own input."""
    monkeypatch.setattr(keyed, "BUFFER_BYTES", 64 * 1024)
    ids = list(range(40_000))
    calls: list[int] = []

    @dg.asset(name="lazy_tickets", io_manager_key="plain")
    def upstream() -> pl.LazyFrame:
        return pl.LazyFrame({"ticket_id": ids, BODY: [f"b{i}" for i in ids]})

    options: dict[str, Any] = {"partitions_def": shard_partitions(shards)} if shards else {}

    @checkpointed_asset(
        source="lazy_tickets", id_column="ticket_id", input_columns=[BODY], **options
    )
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        calls.append(batch.height)
        return batch.select("ticket_id", echo=pl.col(BODY))

    resources = {
        "io_manager": CheckpointIOManager(base_dir=str(tmp_path / "store")),
        "plain": dg.InMemoryIOManager(),
    }
    job = dg.Definitions(assets=[upstream, routed], resources=resources)
    keys = shard_partitions(shards).get_partition_keys() if shards else [None]
    results = []
    for key in keys:
        done = job.resolve_implicit_global_asset_job_def().execute_in_process(partition_key=key)
        assert done.success
        results.append(done.output_for_node("routed"))
    result = pl.concat(results)
    assert sorted(result.get_column("ticket_id").to_list()) == ids
    assert result.filter(pl.col("echo") != "b" + pl.col("ticket_id").cast(pl.String)).height == 0
    assert sum(calls) == len(ids)
