"""Per-row functions through real Dagster materializations: ``def fn(row: dict[str, Any], ...)``
takes one row as a dict and returns a dict of outputs, sync or ``async def``, with resources, the
context, resume, poison rows, rate limits and broken results."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import (
    ASSET,
    Labeller,
    Storage,
    ids_in_shard,
    materialize_asset,
    stats,
    tickets,
)

from checkpoint_assets import (
    CheckpointError,
    RetryAfter,
    checkpointed_asset,
    shard_partitions,
)

ID = "ticket_id"


LABELLER = {"labeller": Labeller(prefix="L:")}


class Rows:
    """The asset's input, changeable between runs, and the rows its function was given."""

    def __init__(self, df: pl.DataFrame) -> None:
        self.df = df
        self.seen: list[dict[str, Any]] = []

    def materialize(
        self,
        storage: Storage,
        asset: dg.AssetsDefinition,
        instance: dg.DagsterInstance,
        *,
        partition_key: str | None = None,
        raise_on_error: bool = True,
    ) -> dg.ExecuteInProcessResult:
        return materialize_asset(
            storage,
            asset,
            self.df,
            instance=instance,
            partition_key=partition_key,
            resources=LABELLER,
            raise_on_error=raise_on_error,
        )


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _labelled(rows: Rows, kind: str, poison: int | None = None) -> dg.AssetsDefinition:
    """A per-row asset using a resource and the context: sync or async as ``kind`` says."""

    def label(row: dict[str, Any], labeller: Labeller, context: Any) -> dict[str, Any]:
        rows.seen.append({**row, "partition": context.partition_key})
        if row[ID] == poison:
            raise ValueError(f"cannot label ticket {row[ID]}")
        return {"label": labeller.prefix + row["body"]}

    settings: dict[str, Any] = {
        "source": "tickets",
        "id_column": ID,
        "input_columns": ["body"],
        "partitions_def": shard_partitions(2),
        "checkpoint_interval": 4,
        "max_concurrency": 4,
        "retry_delay_seconds": 0.0,
        "max_failed_fraction": 0.5,
    }
    if kind == "sync":

        @checkpointed_asset(name=ASSET, **settings)
        def labelled(
            row: dict[str, Any], labeller: Labeller, context: dg.AssetExecutionContext
        ) -> dict[str, Any]:
            return label(row, labeller, context)

        return labelled

    @checkpointed_asset(name=ASSET, **settings)
    async def labelled_async(
        row: Mapping[str, Any], labeller: Labeller, context: dg.AssetExecutionContext
    ) -> dict[str, Any]:
        await asyncio.sleep(0.001)
        return label(dict(row), labeller, context)

    return labelled_async


def test_rows_arrive_as_dicts_with_resources_and_context_and_resume(
    storage: Storage, kind: str
) -> None:
    rows = Rows(tickets(30))
    asset = _labelled(rows, kind)
    instance = dg.DagsterInstance.ephemeral()

    result = rows.materialize(storage, asset, instance, partition_key="0-of-2")

    out = result.output_for_node(ASSET)
    assert out.height == len(rows.seen) > 0
    assert {tuple(sorted(r)) for r in rows.seen} == {("body", "partition", ID)}
    assert {r["partition"] for r in rows.seen} == {"0-of-2"}
    expected = {r[ID]: "L:" + r["body"] for r in rows.seen}
    assert dict(zip(out[ID].to_list(), out["label"].to_list(), strict=True)) == expected
    first = stats(result)
    assert first["rows_computed"] == out.height

    rows.df = tickets(40)
    rows.seen.clear()
    second = stats(rows.materialize(storage, asset, instance, partition_key="0-of-2"))

    assert second["rows_resumed"] == out.height  # only the new rows were called
    assert second["rows_computed"] == len(rows.seen) > 0
    assert all(r[ID] >= 30 for r in rows.seen)


def test_a_poison_row_is_stored_as_failed(storage: Storage, kind: str) -> None:
    rows = Rows(tickets(20))
    poison = ids_in_shard(rows.df, 0, 2)[0]
    asset = _labelled(rows, kind, poison=poison)

    result = rows.materialize(
        storage, asset, dg.DagsterInstance.ephemeral(), partition_key="0-of-2"
    )

    out = result.output_for_node(ASSET)
    failed = out.filter(pl.col("_error").is_not_null())
    assert failed.get_column(ID).to_list() == [poison]
    assert f"cannot label ticket {poison}" in failed.get_column("_error")[0]
    assert out.filter(pl.col("_error").is_null()).height == out.height - 1 > 0
    assert stats(result)["rows_failed"] == 1


def _one_asset(fn: Any) -> tuple[Rows, dg.AssetsDefinition]:
    rows = Rows(tickets(12))
    asset = checkpointed_asset(source="tickets", id_column=ID, name=ASSET, retry_delay_seconds=0.0)(
        fn
    )
    return rows, asset


def test_a_rate_limit_pauses_and_calls_the_row_again(tmp_path: Any) -> None:
    refused: list[int] = []

    async def labelled(row: dict[str, Any]) -> dict[str, Any]:
        if not refused:
            refused.append(row[ID])
            raise RetryAfter(0.05)
        return {"label": row["body"]}

    rows, asset = _one_asset(labelled)
    result = rows.materialize((str(tmp_path), {}), asset, dg.DagsterInstance.ephemeral())

    meta = stats(result)
    assert len(refused) == 1
    assert meta["throttled_calls"] == 1, "the refused call waited and was sent again"
    assert meta["rows_failed"] == 0
    assert result.output_for_node(ASSET).get_column("label").null_count() == 0


def test_a_wrong_return_type_fails_with_a_function_error(tmp_path: Any) -> None:
    calls: list[int] = []

    def labelled(row: dict[str, Any]) -> Any:
        calls.append(row[ID])
        return [row["body"]]

    rows, asset = _one_asset(labelled)
    result = rows.materialize(
        (str(tmp_path), {}), asset, dg.DagsterInstance.ephemeral(), raise_on_error=False
    )

    assert not result.success
    assert len(calls) == 1, "a broken function is not retried"
    (failure,) = result.get_step_failure_events()
    error = failure.step_failure_data.error
    assert error is not None and error.cause is not None
    assert error.cause.cls_name == "FunctionError"
    assert "it returned list; a per-row function must return a dict" in error.cause.message


@pytest.mark.parametrize("annotation", ["dict", "dict[str, Any]", "Mapping[str, Any]"])
def test_the_first_parameters_annotation_picks_the_per_row_form(annotation: str) -> None:
    scope: dict[str, Any] = {"Any": Any, "Mapping": Mapping}
    exec(f"def fn(row: {annotation}): return {{}}", scope)

    with pytest.raises(CheckpointError, match="batch_size=8 asks for that many rows"):
        checkpointed_asset(source="tickets", id_column=ID, batch_size=8)(scope["fn"])
    checkpointed_asset(source="tickets", id_column=ID)(scope["fn"])  # unset: one row per call
