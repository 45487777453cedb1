"""Ids: ids that cannot identify rows are refused before any call."""

from __future__ import annotations

import polars as pl
import pytest
from helpers.jobs import Storage, build_job, tickets

from checkpoint_assets import InvalidIdsError


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
