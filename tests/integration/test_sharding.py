"""Shards: stable keys, every row in exactly one shard, rows never move."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import polars as pl
import pytest
from helpers.jobs import Storage, build_job, stats, tickets

from checkpoint_assets import shard_partitions
from checkpoint_assets.engine.sharding.hashing import shard_of, xxh3
from checkpoint_assets.engine.sharding.scheme import Shard


def test_shard_keys_are_zero_padded_to_the_width_of_n() -> None:
    sixteen = shard_partitions(16)

    assert isinstance(sixteen, dg.StaticPartitionsDefinition)
    assert sixteen.get_partition_keys()[3] == "03-of-16"
    assert sixteen.get_partition_keys() == [f"{i:02d}-of-16" for i in range(16)]
    assert shard_partitions(4).get_partition_keys() == ["0-of-4", "1-of-4", "2-of-4", "3-of-4"]
    assert shard_partitions(100).get_partition_keys()[7] == "007-of-100"
    assert shard_partitions(1).get_partition_keys() == ["0-of-1"]


def test_shard_keys_parse_back_and_other_keys_are_not_shards() -> None:
    assert Shard.parse("03-of-16") == Shard(3, 16)
    assert Shard.parse("3-of-16") == Shard(3, 16)
    assert Shard.parse("2024-01-01") is None
    assert Shard.parse("16-of-16") is None
    with pytest.raises(ValueError, match="between 1 and"):
        shard_partitions(0)
    with pytest.raises(ValueError, match="between 1 and"):
        shard_partitions(2**32)


def test_a_shard_of_any_count_is_one_contiguous_range_of_the_hash_space() -> None:
    ids = pl.Series("id", range(5000))
    hashes = xxh3(ids.to_frame(), "id")
    order = np.argsort(hashes)
    for n in (3, 16, 48, 1000):
        by_hash = shard_of(ids, n)[order]
        assert (np.diff(by_hash) >= 0).all()  # sorted by hash, shards never interleave


def test_all_shards_together_cover_every_row_exactly_once(storage: Storage) -> None:
    df = tickets(60)
    job = build_job(storage, df, partitions_def=shard_partitions(4))

    per_shard: dict[str, list[Any]] = {}
    for key in shard_partitions(4).get_partition_keys():
        result = job.materialize(key)
        per_shard[key] = result.output_for_node("routed")["ticket_id"].to_list()
        assert stats(result)["rows_total"] == len(per_shard[key])

    every = [i for ids in per_shard.values() for i in ids]
    assert sorted(every) == list(range(60))
    assert all(per_shard.values()), "60 ids should reach every one of 4 shards"
    expected = shard_of(df["ticket_id"], 4)
    for index, key in enumerate(shard_partitions(4).get_partition_keys()):
        assert sorted(per_shard[key]) == sorted(df["ticket_id"].filter(expected == index))
    assert sorted(job.computed_ids()) == list(range(60))


def test_an_empty_shard_materializes_with_no_rows(storage: Storage) -> None:
    df = tickets(3)
    job = build_job(storage, df, partitions_def=shard_partitions(16))
    empty = next(
        key
        for index, key in enumerate(shard_partitions(16).get_partition_keys())
        if index not in shard_of(df["ticket_id"], 16).tolist()
    )

    result = job.materialize(empty)

    assert stats(result)["rows_total"] == 0
    assert result.output_for_node("routed").height == 0
    assert job.calls == []
    assert stats(job.materialize(empty))["rows_computed"] == 0


def _shard_ids(tmp_path: Path, df: pl.DataFrame, key: str, **config: Any) -> list[Any]:
    """The ids a run of shard ``key`` computes over ``df`` (nothing stored)."""
    job = build_job((str(tmp_path / "unused"), {}), df, partitions_def=shard_partitions(8))
    job.materialize(key, checkpointing=False, **config)
    return job.computed_ids()


def test_a_row_never_changes_shard_when_the_input_is_reordered_grown_or_limited(
    tmp_path: Path,
) -> None:
    key = "5-of-8"
    original = set(_shard_ids(tmp_path, tickets(80), key))
    reordered = set(
        _shard_ids(tmp_path, tickets(80).sample(fraction=1.0, shuffle=True, seed=3), key)
    )
    grown = set(_shard_ids(tmp_path, pl.concat([tickets(120, start=80), tickets(80)]), key))
    limited = _shard_ids(tmp_path, tickets(80), key, limit=3)

    assert original
    assert reordered == original
    assert grown & set(range(80)) == original
    assert len(limited) == 3 and set(limited) <= original


def test_the_shard_of_an_id_depends_on_the_id_alone() -> None:
    ids = pl.Series("id", list(range(500)))
    shuffled = ids.sample(fraction=1.0, shuffle=True, seed=7)

    by_id = dict(zip(ids.to_list(), shard_of(ids, 16).tolist(), strict=True))
    again = dict(zip(shuffled.to_list(), shard_of(shuffled, 16).tolist(), strict=True))
    alone = {i: int(shard_of(pl.Series("id", [i]), 16)[0]) for i in (0, 17, 499)}

    assert by_id == again
    assert all(by_id[i] == s for i, s in alone.items())
    assert set(by_id.values()) == set(range(16))
