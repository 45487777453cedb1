"""What a checkpointed function may take and return, through real Dagster materializations:
resources by name, the execution context, a signature checked at definition, a broken result
stopping at once, rows per call from run config, usage and throttling metadata, adaptive
concurrency settings."""

from __future__ import annotations

import threading
import time
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import (
    ASSET,
    Labeller,
    Storage,
    build_job,
    materialize_asset,
    route,
    stats,
    tickets,
)

from checkpoint_assets import (
    CheckpointError,
    CheckpointIOManager,
    RetryAfter,
    checkpointed_asset,
    shard_partitions,
)

ID = "ticket_id"


def test_resources_and_the_context_reach_the_function(tmp_path: Any) -> None:
    seen: list[tuple[str, str]] = []

    @checkpointed_asset(
        source="tickets", id_column=ID, partitions_def=shard_partitions(2), checkpoint_interval=4
    )
    def labelled(
        batch: pl.DataFrame, labeller: Labeller, context: dg.AssetExecutionContext, plain: Any
    ) -> pl.DataFrame:
        seen.append((context.partition_key, plain.prefix))
        return batch.select(ID, label=pl.lit(labeller.prefix) + pl.col("body"))

    assert labelled.required_resource_keys >= {"labeller", "plain"}
    result = materialize_asset(
        (str(tmp_path), {}),
        labelled,
        tickets(20),
        partition_key="1-of-2",
        resources={"labeller": Labeller(prefix="L:"), "plain": Labeller(prefix="P")},
    )

    out = result.output_for_node("labelled")
    assert out.height > 0 and (out.get_column("label").str.starts_with("L:b")).all()
    assert {s for s in seen} == {("1-of-2", "P")}


def test_a_missing_resource_fails_when_the_definitions_load(tmp_path: Any) -> None:
    @checkpointed_asset(source="tickets", id_column=ID)
    def labelled(batch: pl.DataFrame, labeller: Labeller) -> pl.DataFrame:
        return route(batch)

    @dg.asset(name="tickets")
    def source() -> pl.DataFrame:
        return tickets(2)

    defs = dg.Definitions(
        assets=[source, labelled],
        resources={"io_manager": CheckpointIOManager(base_dir=str(tmp_path))},
    )
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="labeller"):
        dg.Definitions.validate_loadable(defs)


@pytest.mark.parametrize(
    "signature, problem",
    [
        ("def fn(batch, retries: int): ...", "`retries: int` is neither the execution context"),
        ("def fn(batch, *more): ...", "named parameters only"),
        ("def fn(): ...", "its first parameter must be the batch"),
        ("def fn(*, batch): ...", "its first parameter must be the batch"),
    ],
)
def test_a_signature_that_cannot_be_called_fails_the_definition(
    signature: str, problem: str
) -> None:
    scope: dict[str, Any] = {}
    exec(signature, scope)

    with pytest.raises(CheckpointError) as raised:
        checkpointed_asset(source="tickets", id_column=ID)(scope["fn"])

    message = str(raised.value)
    assert problem in message
    assert "the batch first, then Dagster resources by their key" in message


def test_a_wrong_return_type_fails_on_the_first_call(storage: Storage) -> None:
    job = build_job(storage, tickets(20), fn=lambda batch: batch.to_dicts(), max_attempts=3)

    result = job.materialize(raise_on_error=False)

    assert not result.success
    assert len(job.calls) == 1, "a broken function is not retried nor split"
    (failure,) = result.get_step_failure_events()
    error = failure.step_failure_data.error
    assert error is not None
    assert error.cause is not None and error.cause.cls_name == "FunctionError"
    assert "it returned list; it must return a polars DataFrame" in error.cause.message
    assert "Fix the function, then" in error.cause.message


def test_batch_size_in_run_config_overrides_the_asset(storage: Storage) -> None:
    job = build_job(storage, tickets(24), checkpoint_interval=8)

    job.materialize(batch_size=3)

    assert [len(c) for c in job.calls] == [3] * 8


def test_usage_and_throttling_reach_the_materialization_metadata(storage: Storage) -> None:
    throttled = {"left": 1}

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        if throttled["left"]:
            throttled["left"] -= 1
            raise RetryAfter(0.05)
        return route(batch).with_columns(tokens=pl.lit(10), cost=pl.lit(0.25))

    job = build_job(storage, tickets(12), fn=fn, usage_columns=["tokens", "cost"])
    first = stats(job.materialize())

    assert first["usage/tokens"] == 120 and first["usage/cost"] == 3.0
    assert first["usage_total/tokens"] == 120
    assert first["throttled_calls"] == 1, "the refused call waited and was sent again"
    assert first["throttle_events"] == 0 and first["throttled_seconds"] == 0, "one refusal"
    assert first["concurrency_final"] == 1 and first["rows_failed"] == 0

    job.set_input(tickets(16))
    second = stats(job.materialize())
    assert second["usage/tokens"] == 40 and second["usage_total/tokens"] == 160
    assert second["throttle_events"] == 0 and second["throttled_calls"] == 0


def test_adaptive_concurrency_off_keeps_max_concurrency_against_a_refusing_endpoint(
    storage: Storage,
) -> None:
    lock = threading.Lock()
    busy = [0]

    def one_at_a_time(batch: pl.DataFrame) -> pl.DataFrame:  # an endpoint admitting one call
        with lock:
            if busy[0]:
                raise RetryAfter(0.01)
            busy[0] += 1
        try:
            time.sleep(0.005)
            return route(batch)
        finally:
            with lock:
                busy[0] -= 1

    job = build_job(
        storage,
        tickets(200),
        fn=one_at_a_time,
        batch_size=1,
        checkpoint_interval=16,
        max_concurrency=8,
        adaptive_concurrency=False,
    )
    meta = stats(job.materialize())

    assert meta["rows_failed"] == 0 and meta["throttled_calls"] > 0
    assert meta["concurrency_final"] == 8  # (most calls refused: the shard still pauses)


def test_a_min_concurrency_above_max_concurrency_fails_the_definition() -> None:
    with pytest.raises(ValueError, match=r"min_concurrency must be between 1 and max_concurrency"):

        @checkpointed_asset(source="tickets", id_column=ID, max_concurrency=4, min_concurrency=8)
        def asset(batch: pl.DataFrame) -> pl.DataFrame:
            return batch


def test_the_asset_key_of_a_function_with_resources_is_its_name() -> None:
    @checkpointed_asset(source="tickets", id_column=ID)
    def routed(batch: pl.DataFrame, labeller: Labeller) -> pl.DataFrame:
        return route(batch)

    assert routed.key == dg.AssetKey(ASSET)
