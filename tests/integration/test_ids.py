"""Ids: ids that cannot identify rows are refused before any call."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import Storage, build_job, route, step_error, tickets

from checkpoint_assets import (
    CheckpointIOManager,
    InvalidIdsError,
    checkpointed_asset,
    shard_partitions,
)
from checkpoint_assets.engine.sharding.hashing import shard_of


def _refused(storage: Storage, df: pl.DataFrame) -> str:
    job = build_job(storage, df)
    with pytest.raises(InvalidIdsError) as raised:
        job.materialize()
    assert job.calls == [], "the function must not be called with invalid ids"
    assert job.files() == {}, "nothing may be stored for a refused input"
    return str(raised.value)


def test_duplicate_ids_are_refused_naming_the_column_and_five_values(storage: Storage) -> None:
    df = pl.concat([tickets(20), tickets(7, start=3)])  # ids 3..9 appear twice

    message = _refused(storage, df)

    assert "'ticket_id'" in message
    assert "7 duplicated" in message
    assert "[3, 4, 5, 6, 7]" in message


def test_null_ids_are_refused_naming_the_column_and_where_they_are(storage: Storage) -> None:
    df = tickets(10).with_columns(
        pl.when(pl.col("ticket_id").is_in([2, 5]))
        .then(None)
        .otherwise(pl.col("ticket_id"))
        .alias("ticket_id")
    )

    message = _refused(storage, df)

    assert "'ticket_id'" in message
    assert "2 null" in message
    assert "[2, 5]" in message


def test_float_ids_are_refused_naming_the_column_type_and_values(storage: Storage) -> None:
    df = tickets(10).with_columns((pl.col("ticket_id") + 0.5).alias("ticket_id"))

    message = _refused(storage, df)

    assert "'ticket_id'" in message
    assert "Float64" in message
    assert "[0.5, 1.5, 2.5, 3.5, 4.5]" in message
    assert "5.5" not in message


def test_missing_id_column_is_refused_listing_the_columns(storage: Storage) -> None:
    message = _refused(storage, tickets(5).rename({"ticket_id": "id"}))

    assert "'ticket_id'" in message
    assert "'id'" in message


def test_string_ids_are_accepted_and_resumed(storage: Storage) -> None:
    df = tickets(12).with_columns(pl.format("t-{}", pl.col("ticket_id")).alias("ticket_id"))
    job = build_job(storage, df)

    first = job.materialize()
    job.calls.clear()
    job.materialize()

    assert sorted(first.output_for_node("routed")["ticket_id"]) == sorted(df["ticket_id"])
    assert job.calls == []


# -- where the refused ids are, as the user's source holds them ---------------------------------
def _shard_error(df: pl.DataFrame, stored: bool, tmp_path: Path) -> tuple[str, Path, list[int]]:
    """Materialize ``df`` as the source (stored by CheckpointIOManager, reordered by shard key,
    or held in memory as returned) and the shard of 4 that holds ``df``'s first refused id;
    returns the error, the checkpoints' folder, and the rows the function was called with."""
    calls: list[int] = []

    @dg.asset(name="tickets", io_manager_key="io_manager" if stored else "source_io")
    def source() -> pl.DataFrame:
        return df

    @checkpointed_asset(
        source="tickets", id_column="ticket_id", name="routed", partitions_def=shard_partitions(4)
    )
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        calls.extend(batch.get_column("ticket_id").to_list())
        return route(batch)

    base_dir = tmp_path / "checkpoints"
    resources = {
        "io_manager": CheckpointIOManager(base_dir=str(base_dir)),
        "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
    }
    ids = df.get_column("ticket_id")
    bad = ids.filter(ids.is_null() | ids.is_duplicated()).fill_null(0).head(1)
    key = shard_partitions(4).get_partition_keys()[int(shard_of(bad, 4)[0])]
    result = dg.materialize(
        [source, routed], partition_key=key, resources=resources, raise_on_error=False
    )
    return step_error(result), base_dir / "routed", calls


@pytest.mark.parametrize("stored", [True, False], ids=["stored source", "source in memory"])
def test_a_null_id_is_reported_at_its_row_in_the_source(stored: bool, tmp_path: Path) -> None:
    ids = [10, 11, 12, 13, 14, None, 16, 17, 18, 19]
    df = tickets(10).with_columns(pl.Series("ticket_id", ids))

    error, checkpoints, calls = _shard_error(df, stored, tmp_path)

    assert error.startswith("InvalidIdsError: ")
    assert "'ticket_id' has 1 null value(s), at rows [5] of the source" in error
    assert "its first row is row 0" in error
    assert "fix the source" in error
    assert calls == [] and not checkpoints.exists()  # nothing called, nothing stored


@pytest.mark.parametrize("stored", [True, False], ids=["stored source", "source in memory"])
def test_a_duplicated_id_is_reported_at_its_rows_in_the_source(
    stored: bool, tmp_path: Path
) -> None:
    df = tickets(10).with_columns(pl.Series("ticket_id", [10, 11, 12, 13, 14, 15, 16, 17, 12, 19]))

    error, checkpoints, calls = _shard_error(df, stored, tmp_path)

    assert error.startswith("InvalidIdsError: ")
    assert "has 1 duplicated value(s) (12 at rows [2, 8] of the source;" in error
    assert calls == [] and not checkpoints.exists()
