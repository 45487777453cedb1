"""Resharding: finished rows survive any change of shard scheme, and a range shard reads only
the checkpoints of earlier shard counts that overlap it."""

from __future__ import annotations

import io
import json
from typing import Any

import dagster as dg
import numpy as np
import polars as pl
import pytest

from checkpoint_assets import (
    CheckpointError,
    CheckpointIOManager,
    checkpointed_asset,
    global_resume_asset,
    shard_partitions,
)
from checkpoint_assets.engine.checkpoints import parquet
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.storage import open_store

ROWS = 600


@dg.asset
def items() -> pl.DataFrame:
    return pl.DataFrame({"item_id": range(ROWS), "text": [f"text {i}" for i in range(ROWS)]})


def routing_for(shards: int | None, calls: list[int], **kwargs: Any) -> dg.AssetsDefinition:
    """The same job under a given shard scheme (as after editing shard_partitions(n))."""

    @checkpointed_asset(
        source="items",
        id_column="item_id",
        partitions_def=shard_partitions(shards) if shards else None,
        checkpoint_interval=50,
        code_version="v1",
        **kwargs,
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
    env: dict[str, Any],
    assets: list[Any],
    select: Any,
    key: str | None = None,
    *,
    tags: dict[str, str] | None = None,
    raise_on_error: bool = True,
    **config: Any,
) -> dg.ExecuteInProcessResult:
    run_config = {"ops": {"routing": {"config": config}}} if config else None
    return dg.materialize(
        [items, *assets],
        selection=[select],
        partition_key=key,
        run_config=run_config,
        tags=tags,
        raise_on_error=raise_on_error,
        instance=env["instance"],
        resources=env["resources"],
    )


def run_range(env: dict[str, Any], asset: Any, keys: list[str], **config: Any) -> dict[str, Any]:
    """One run over the shards ``keys`` (the asset needs ``BackfillPolicy.single_run()``)."""
    tags = {
        "dagster/asset_partition_range_start": keys[0],
        "dagster/asset_partition_range_end": keys[-1],
    }
    return meta(run(env, [asset], asset, tags=tags, **config))


def logs(env: dict[str, Any], result: dg.ExecuteInProcessResult) -> list[str]:
    return [e.user_message for e in env["instance"].all_logs(result.run_id) if e.user_message]


def meta(result: dg.ExecuteInProcessResult, node: str = "routing") -> dict[str, Any]:
    found = result.asset_materializations_for_node(node)[0].metadata
    return {k: v.value for k, v in found.items()}


@pytest.mark.parametrize(
    ("old", "new"), [(4, 8), (8, 2), (None, 3)], ids=["4->8", "8->2", "unpartitioned->3"]
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


def test_the_table_keeps_the_result_of_the_newest_checkpoint_of_each_id(
    env: dict[str, Any],
) -> None:
    four = routing_for(4, [])
    for key in shard_partitions(4).get_partition_keys():
        run(env, [four], four, key)

    @checkpointed_asset(
        source="items",
        id_column="item_id",
        partitions_def=shard_partitions(2),
        checkpoint_interval=50,
        code_version="v1",  # the same job, as far as fingerprints go
    )
    def routing(batch: pl.DataFrame) -> pl.DataFrame:
        return batch.select("item_id", upper=pl.lit("NEWER"))

    newer = run(env, [routing], routing, "0-of-2", resume=False).output_for_node("routing")
    reconcile = global_resume_asset(routing)
    run(env, [routing, reconcile], reconcile)
    table = stored_table(env, "default")

    assert table.height == ROWS
    assert table["item_id"].n_unique() == ROWS
    newest = set(newer["item_id"].to_list())
    by_id = dict(zip(table["item_id"].to_list(), table["upper"].to_list(), strict=True))
    assert {by_id[i] for i in newest} == {"NEWER"}
    assert all(by_id[i] == f"TEXT {i}" for i in set(range(ROWS)) - newest)


def stored_table(env: dict[str, Any], tag: str) -> pl.DataFrame:
    """The global resume table of ``tag``, where the asset stores it."""
    manager = env["resources"]["io_manager"]
    store = open_store(manager.base_dir, manager.storage_options)
    data = store.get(store.path("routing_global_resume", f"{tag}.parquet"))
    return pl.read_parquet(io.BytesIO(data))


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


def reconcile_tags(
    env: dict[str, Any], assets: list[Any], *tags: str | None
) -> list[dict[str, Any]]:
    """Materialize the global resume asset once per tag given (None: without run config)."""
    reconcile = next(a for a in assets if a.key.path[-1] == "routing_global_resume")
    out = []
    for tag in tags:
        config = {"checkpoint_tag": tag} if tag else {}
        result = dg.materialize(
            [items, *assets],
            selection=[reconcile],
            run_config={"ops": {"routing_global_resume": {"config": config}}},
            **env,
        )
        out.append(meta(result, "routing_global_resume"))
    return out


def test_a_shard_never_imports_rows_of_another_checkpoint_tag(env: dict[str, Any]) -> None:
    calls: list[int] = []
    one = routing_for(None, calls)
    run(env, [one], one, checkpoint_tag="a")  # every row, under tag a
    run(env, [one], one, checkpoint_tag="b", limit=10)  # a smoke run under tag b
    smoke = set(calls[-10:])
    calls.clear()
    two = routing_for(2, calls)
    reconcile = global_resume_asset(two)
    # Unpartitioned checkpoints: the shards of both tags need the table.
    reconcile_tags(env, [two, reconcile], "b", "a")

    imported = computed = 0
    for key in shard_partitions(2).get_partition_keys():
        result = meta(run(env, [two], two, key, checkpoint_tag="b", global_resume=True))
        imported += result["rows_imported"]
        computed += result["rows_computed"]

    assert (imported, computed) == (10, ROWS - 10)
    assert set(calls) == set(range(ROWS)) - smoke


def test_the_table_is_built_for_every_tag_on_storage_each_on_its_own(
    env: dict[str, Any],
) -> None:
    calls: list[int] = []
    one = routing_for(None, calls)
    for tag, limit in (("a", ROWS), ("b", 10)):
        run(env, [one], one, checkpoint_tag=tag, limit=limit)
    two = routing_for(2, calls)
    reconcile = global_resume_asset(two)

    [built] = reconcile_tags(env, [two, reconcile], None)

    assert built["tags"] == ["a", "b"]
    assert built["rows_finished"] == ROWS + 10
    calls.clear()
    for tag, expected in (("a", ROWS), ("b", 10)):
        keys = shard_partitions(2).get_partition_keys()
        runs = [meta(run(env, [two], two, k, checkpoint_tag=tag, global_resume=True)) for k in keys]
        assert sum(r["rows_imported"] for r in runs) == expected
    assert len(calls) == ROWS - 10  # only tag b's rows left to compute


def test_global_resume_without_the_table_says_what_to_materialize(env: dict[str, Any]) -> None:
    one = routing_for(None, [])
    run(env, [one], one)  # an unpartitioned checkpoint: its rows may belong to any shard
    two = routing_for(2, [])
    with pytest.raises(CheckpointError, match=r"not range shards.*materialize it first"):
        run(env, [two], two, "0-of-2", global_resume=True)


@pytest.mark.parametrize("build", ["table", "resized shard"])
def test_a_merged_file_with_duplicate_ids_is_reported_not_imported(
    env: dict[str, Any], build: str
) -> None:
    four = routing_for(4, [])
    for key in shard_partitions(4).get_partition_keys():
        run(env, [four], four, key)
    io_manager = env["resources"]["io_manager"]
    store = open_store(io_manager.base_dir, io_manager.storage_options)
    damaged = Checkpoint(store, "routing/default/1-of-4")
    frame, watermark = damaged.read_merged()
    assert frame is not None
    twice = pl.concat([frame, frame.head(3).with_columns(pl.col("upper") + "?")])
    store.put(damaged.files.merged, parquet.encode(twice, {parquet.WATERMARK_KEY: str(watermark)}))

    two = routing_for(2, [])
    with pytest.raises(CheckpointError, match=r"1-of-4.parquet holds duplicate ids"):
        if build == "table":
            reconcile = global_resume_asset(two)
            run(env, [two, reconcile], reconcile)
        else:
            run(env, [two], two, "0-of-2", global_resume=True)


def test_range_shards_need_no_table_when_every_earlier_scheme_is_range_shards(
    env: dict[str, Any],
) -> None:
    calls: list[int] = []
    four = routing_for(4, calls, backfill_policy=dg.BackfillPolicy.single_run())
    run_range(env, four, shard_partitions(4).get_partition_keys())
    calls.clear()

    two = routing_for(2, calls)  # no global resume asset anywhere
    for key in shard_partitions(2).get_partition_keys():
        result = run(env, [two], two, key, global_resume=True)
        assert meta(result)["rows_computed"] == 0
        assert any("2 overlapping checkpoint(s)" in line for line in logs(env, result))
    assert calls == []


@pytest.mark.parametrize("storage", ["local"], indirect=True)  # request counts are the store's
def test_resharding_64_to_48_reads_only_the_overlapping_checkpoints_and_loses_nothing(
    env: dict[str, Any],
) -> None:
    calls: list[int] = []
    single_run = dg.BackfillPolicy.single_run()
    old = routing_for(64, calls, backfill_policy=single_run)
    run_range(env, old, shard_partitions(64).get_partition_keys())
    assert sorted(calls) == list(range(ROWS))
    calls.clear()

    new = routing_for(48, calls, backfill_policy=single_run)
    keys = shard_partitions(48).get_partition_keys()
    for index in (0, 47):
        used = meta(run(env, [new], new, keys[index], global_resume=True))
        # The same shard on a tag where nothing is stored: what a run reads for itself.
        fresh = meta(
            run(env, [new], new, keys[index], checkpoint_tag=f"x{index}", global_resume=True)
        )
        calls.clear()  # the baseline run computed its rows; the resharded one did not

        overlaps = len(hashing.overlapping(index, 48, 64))
        assert overlaps <= -(-64 // 48) + 1
        # Each overlapping checkpoint: its meta, its merged file, a listing of its parts.
        extra = {
            k: used[f"storage_requests/{k}"] - fresh[f"storage_requests/{k}"]
            for k in ("get", "list")
        }
        assert extra == {"get": 2 * overlaps, "list": overlaps}
        assert used["rows_computed"] == 0
        assert used["rows_imported"] == used["rows_total"] > 0
    rest = run_range(env, new, keys, global_resume=True)
    assert rest["rows_computed"] == 0
    assert calls == []
    summary = dg.materialize(
        [items, new, routing_summary], selection=[routing_summary], **env
    ).output_for_node("routing_summary")
    assert sorted(summary["item_id"].to_list()) == list(range(ROWS))
    assert summary["upper"].to_list() == [f"TEXT {i}" for i in summary["item_id"]]


@dg.asset
def routing_summary(routing: pl.DataFrame) -> pl.DataFrame:
    return routing


def items_of(ids: list[int]) -> dg.AssetsDefinition:
    """``items`` holding only ``ids``."""

    @dg.asset(name="items")
    def some_items() -> pl.DataFrame:
        return pl.DataFrame({"item_id": ids, "text": [f"text {i}" for i in ids]})

    return some_items


def write_mod_rule_checkpoints(env: dict[str, Any], count: int, done: set[int]) -> None:
    """Checkpoints in the modulo layout of releases without range sharding.

    Shard ``i`` of ``count`` holds the ids whose hash is ``i`` modulo ``count``, and its meta
    records no rule. Each is written by a real run (of the unpartitioned job over that shard's
    finished rows ``done``), then moved to the shard's name."""
    manager = env["resources"]["io_manager"]
    store = open_store(manager.base_dir, manager.storage_options)
    ids = pl.Series("item_id", range(ROWS))
    mod = hashing.xxh3(ids.to_frame(), "item_id") % np.uint64(count)
    for index in range(count):
        mine = sorted(set(ids.filter(pl.Series(mod == index)).to_list()) & done)
        dg.materialize(
            [items_of(mine), routing_for(None, [])],
            run_config={"ops": {"routing": {"config": {"checkpoint_tag": "legacy"}}}},
            **env,
        )
        written = store.path("routing", "legacy", "all.parquet")
        key = shard_partitions(count).get_partition_keys()[index]
        moved = store.path("routing", "default", key + ".parquet")
        for info in store.list_recursive(store.path("routing", "legacy")):
            data = store.get(info.path)
            if info.path.endswith(".meta.json"):
                recorded = json.loads(data)
                recorded["scheme"] = {"kind": "shard", "index": index, "count": count}
                data = json.dumps(recorded).encode()
            store.put(info.path.replace(written, moved), data)
            store.delete([info.path])
    dg.materialize([items], **env)  # the whole input again


def test_checkpoints_of_the_mod_rule_are_resharded_in_place_by_global_resume(
    env: dict[str, Any],
) -> None:
    write_mod_rule_checkpoints(env, 4, set(range(ROWS)))
    calls: list[int] = []
    four = routing_for(4, calls)
    reconcile = global_resume_asset(four)

    refused = run(env, [four], four, "1-of-4", raise_on_error=False)
    assert not refused.success
    failure = next(e for e in refused.all_events if e.is_step_failure)
    assert failure.step_failure_data is not None
    message = str(failure.step_failure_data.error)
    assert "earlier shard rule (4 shards (mod rule))" in message
    assert "global_resume: true" in message
    assert calls == []

    table = meta(run(env, [four, reconcile], reconcile), "routing_global_resume")
    assert (table["rows_finished"], table["schemes"]) == (ROWS, ["4 shards (mod rule)"])
    results = []
    for key in shard_partitions(4).get_partition_keys():
        result = run(env, [four, reconcile], four, key, global_resume=True)
        assert meta(result)["rows_computed"] == 0
        results.append(result.output_for_node("routing"))
    assert calls == []
    assert sorted(pl.concat(results)["item_id"].to_list()) == list(range(ROWS))

    # Now every scheme is range shards: the next reshard reads only what overlaps.
    table = meta(run(env, [four, reconcile], reconcile), "routing_global_resume")
    assert table["schemes"] == ["4 shards"]
    two = routing_for(2, calls)
    for key in shard_partitions(2).get_partition_keys():
        result = run(env, [two], two, key, global_resume=True)
        assert meta(result)["rows_computed"] == 0
        assert any("2 overlapping checkpoint(s)" in line for line in logs(env, result))
    assert calls == []


def test_a_mix_of_mod_and_range_schemes_falls_back_to_the_table_and_loses_nothing(
    env: dict[str, Any],
) -> None:
    mod_done = set(range(0, ROWS, 2))
    write_mod_rule_checkpoints(env, 4, mod_done)
    calls: list[int] = []
    three = routing_for(3, calls)
    run(env, [three], three, "1-of-3")
    range_done = set(calls)
    calls.clear()

    two = routing_for(2, calls)
    reconcile = global_resume_asset(two)
    table = meta(run(env, [two, reconcile], reconcile), "routing_global_resume")
    assert set(table["schemes"]) == {"4 shards (mod rule)", "3 shards"}
    for key in shard_partitions(2).get_partition_keys():
        result = run(env, [two, reconcile], two, key, global_resume=True)
        assert not any("overlapping checkpoint" in line for line in logs(env, result))

    assert sorted(calls) == sorted(set(range(ROWS)) - mod_done - range_done)


def test_global_resume_asset_refuses_a_plain_asset() -> None:
    with pytest.raises(CheckpointError, match="checkpointed_asset"):
        global_resume_asset(items)
