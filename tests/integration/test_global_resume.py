"""Resharding: finished rows survive any change of shard scheme."""

from __future__ import annotations

from typing import Any

import dagster as dg
import polars as pl
import pytest

from checkpoint_assets import (
    CheckpointError,
    CheckpointIOManager,
    checkpointed_asset,
    global_resume_asset,
    shard_partitions,
)

ROWS = 600


@dg.asset
def items() -> pl.DataFrame:
    return pl.DataFrame({"item_id": range(ROWS), "text": [f"text {i}" for i in range(ROWS)]})


def routing_for(shards: int | None, calls: list[int]) -> dg.AssetsDefinition:
    """The same job under a given shard scheme (as after editing shard_partitions(n))."""

    @checkpointed_asset(
        source="items",
        id_column="item_id",
        partitions_def=shard_partitions(shards) if shards else None,
        checkpoint_interval=50,
        code_version="v1",
    )
    def routing(batch: pl.DataFrame) -> pl.DataFrame:
        calls.extend(batch["item_id"].to_list())
        return batch.select("item_id", upper=pl.col("text").str.to_uppercase())

    return routing


@pytest.fixture
def env(storage: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    base_dir, options = storage
    instance = dg.DagsterInstance.ephemeral()
    resources = {"io_manager": CheckpointIOManager(base_dir=base_dir, storage_options=options)}
    dg.materialize([items], instance=instance, resources=resources)
    return {"instance": instance, "resources": resources}


def run(
    env: dict[str, Any], assets: list[Any], select: Any, key: str | None = None, **config: Any
) -> dg.ExecuteInProcessResult:
    run_config = {"ops": {"routing": {"config": config}}} if config else None
    return dg.materialize(
        [items, *assets],
        selection=[select],
        partition_key=key,
        run_config=run_config,
        **env,
    )


def meta(result: dg.ExecuteInProcessResult, node: str = "routing") -> dict[str, Any]:
    found = result.asset_materializations_for_node(node)[0].metadata
    return {k: v.value for k, v in found.items()}


@pytest.mark.parametrize(
    ("old", "new"), [(8, 16), (16, 4), (None, 3)], ids=["8->16", "16->4", "unpartitioned->3"]
)
def test_resharding_recomputes_nothing_that_was_finished(
    env: dict[str, Any], old: int | None, new: int
) -> None:
    calls: list[int] = []
    before = routing_for(old, calls)
    for key in shard_partitions(old).get_partition_keys() if old else [None]:
        run(env, [before], before, key)
    assert sorted(calls) == list(range(ROWS))
    calls.clear()

    after = routing_for(new, calls)
    reconcile = global_resume_asset(after)
    table = meta(run(env, [after, reconcile], reconcile), "routing_global_resume")
    assert table["rows_finished"] == ROWS
    computed = resumed = 0
    results = []
    for key in shard_partitions(new).get_partition_keys():
        result = run(env, [after, reconcile], after, key, global_resume=True)
        computed += meta(result)["rows_computed"]
        resumed += meta(result)["rows_resumed"]
        results.append(result.output_for_node("routing"))

    assert calls == []
    assert (computed, resumed) == (0, ROWS)
    union = pl.concat(results)
    assert union["item_id"].sort().to_list() == list(range(ROWS))
    assert union["upper"].to_list() == [f"TEXT {i}" for i in union["item_id"]]


def test_global_resume_reads_every_scheme_on_storage_not_only_the_current_count(
    env: dict[str, Any],
) -> None:
    calls: list[int] = []
    four = routing_for(4, calls)
    run(env, [four], four, "0-of-4")  # a quarter under 4 shards
    three = routing_for(3, calls)
    run(env, [three], three, "1-of-3")  # a third under 3 shards
    finished = set(calls)
    calls.clear()

    two = routing_for(2, calls)
    reconcile = global_resume_asset(two)
    table = meta(run(env, [two, reconcile], reconcile), "routing_global_resume")
    assert table["rows_finished"] == len(finished)
    assert set(table["schemes"]) == {"4 shards", "3 shards"}
    for key in shard_partitions(2).get_partition_keys():
        run(env, [two, reconcile], two, key, global_resume=True)

    assert set(calls) == set(range(ROWS)) - finished
    assert len(calls) == len(set(calls))


def test_global_resume_skips_rows_whose_input_changed(env: dict[str, Any]) -> None:
    calls: list[int] = []
    one = routing_for(None, calls)
    run(env, [one], one)
    calls.clear()

    @dg.asset(name="items")
    def edited_items() -> pl.DataFrame:
        texts = [f"text {i}" if i != 7 else "changed" for i in range(ROWS)]
        return pl.DataFrame({"item_id": range(ROWS), "text": texts})

    dg.materialize([edited_items], **env)
    two = routing_for(2, calls)
    reconcile = global_resume_asset(two)
    dg.materialize([edited_items, two, reconcile], selection=[reconcile], **env)
    for key in shard_partitions(2).get_partition_keys():
        dg.materialize(
            [edited_items, two, reconcile],
            selection=[two],
            partition_key=key,
            run_config={"ops": {"routing": {"config": {"global_resume": True}}}},
            **env,
        )

    assert calls == [7]


def test_global_resume_without_the_table_says_what_to_materialize(env: dict[str, Any]) -> None:
    two = routing_for(2, [])
    with pytest.raises(CheckpointError, match="materialize it first"):
        run(env, [two], two, "0-of-2", global_resume=True)


def test_global_resume_asset_refuses_a_plain_asset() -> None:
    with pytest.raises(CheckpointError, match="checkpointed_asset"):
        global_resume_asset(items)
