"""Results reused by content: a row whose function and input the result store holds takes its
result, with no call, whatever its asset, tag or id (issue 35)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import Storage

from checkpoint_assets import (
    Budget,
    CheckpointIOManager,
    OpenAIResource,
    checkpointed_asset,
    provider_batch_asset,
    shard_partitions,
)
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.storage import open_store
from examples.llm_batch.provider import serve as serve_batches
from examples.llm_batch.provider import stats as batch_stats
from examples.llm_openai.server import serve, stats

CALLED: list[str] = []  # the bodies each call was given, across assets


def routed(batch: pl.DataFrame) -> pl.DataFrame:
    CALLED.extend(batch.get_column("body").to_list())
    return batch.select(
        "ticket_id",
        route=pl.col("body").str.to_uppercase(),
        input_tokens=pl.col("body").str.len_chars(),
        output_tokens=pl.lit(10),
    )


def rerouted(batch: pl.DataFrame) -> pl.DataFrame:  # another function: its results differ
    CALLED.extend(batch.get_column("body").to_list())
    return batch.select(
        "ticket_id",
        route=pl.col("body").str.to_lowercase(),
        input_tokens=pl.col("body").str.len_chars(),
        output_tokens=pl.lit(10),
    )


def bodies(ids: range, *, offset: int = 0) -> pl.DataFrame:
    """Tickets with ids ``ids`` shifted by ``offset``; a body depends on the unshifted id."""
    return pl.DataFrame(
        {"ticket_id": [i + offset for i in ids], "body": [f"ticket body {i}" for i in ids]}
    )


def asset_of(name: str, fn: Callable[..., Any], source: str, **kw: Any) -> dg.AssetsDefinition:
    arguments: dict[str, Any] = {"checkpoint_interval": 8, "input_columns": ["body"], "reuse": True}
    return checkpointed_asset(source=source, id_column="ticket_id", name=name, **(arguments | kw))(
        fn
    )


def run(
    storage: Storage,
    asset: dg.AssetsDefinition,
    data: pl.DataFrame,
    *,
    source: str = "tickets",
    config: dict[str, Any] | None = None,
    resources: dict[str, Any] | None = None,
    partition_key: str | None = None,
    **io: Any,
) -> dict[str, Any]:
    """Materialize ``asset`` over ``data``; its metadata; ``CALLED`` holds its calls only."""
    CALLED.clear()

    @dg.asset(name=source, io_manager_key="source_io")
    def tickets() -> pl.DataFrame:
        return data

    base_dir, options = storage
    result = dg.materialize(
        [tickets, asset],
        resources={
            "io_manager": CheckpointIOManager(base_dir=base_dir, storage_options=options, **io),
            "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
            **(resources or {}),
        },
        run_config={"ops": {asset.key.path[-1]: {"config": config}}} if config else None,
        partition_key=partition_key,
    )
    (materialization,) = result.asset_materializations_for_node(asset.key.path[-1])
    values = {k: v.value for k, v in materialization.metadata.items()}
    output = result.output_for_node(asset.key.path[-1])
    values["result"] = output.sort("ticket_id")
    return values


def expected(data: pl.DataFrame) -> pl.DataFrame:
    return data.select("ticket_id", route=pl.col("body").str.to_uppercase()).sort("ticket_id")


def test_a_second_asset_over_a_half_overlapping_table_computes_only_the_new_half(
    storage: Storage,
) -> None:
    first, second = bodies(range(0, 40)), bodies(range(20, 60))
    run(storage, asset_of("first", routed, "tickets"), first)

    meta = run(storage, asset_of("second", routed, "other_tickets"), second, source="other_tickets")

    assert sorted(CALLED) == sorted(f"ticket body {i}" for i in range(40, 60))
    assert (meta["rows_from_store"], meta["rows_computed"]) == (20, 20)
    assert meta["result"].select("ticket_id", "route").equals(expected(second))
    assert meta["result"].get_column("_error").null_count() == 40


def test_a_new_checkpoint_tag_takes_every_result_from_the_store(storage: Storage) -> None:
    data = bodies(range(30))
    asset = asset_of("first", routed, "tickets")
    run(storage, asset, data)

    meta = run(storage, asset, data, config={"checkpoint_tag": "again"})

    assert CALLED == []
    assert (meta["rows_from_store"], meta["rows_computed"], meta["calls"]) == (30, 0, 0)
    assert meta["result"].select("ticket_id", "route").equals(expected(data))


def test_renumbered_ids_take_their_results_by_content(storage: Storage) -> None:
    asset = asset_of("first", routed, "tickets")
    run(storage, asset, bodies(range(30)))

    renumbered = bodies(range(30), offset=1000)
    meta = run(storage, asset, renumbered, config={"checkpoint_tag": "renumbered"})

    assert CALLED == []
    assert meta["rows_from_store"] == 30
    assert meta["result"].select("ticket_id", "route").equals(expected(renumbered))


def test_a_changed_function_misses_the_store(storage: Storage) -> None:
    data = bodies(range(20))
    run(storage, asset_of("first", routed, "tickets"), data)

    meta = run(storage, asset_of("second", rerouted, "tickets"), data)

    assert len(CALLED) == 20
    assert (meta["rows_from_store"], meta["rows_computed"]) == (0, 20)
    lower = data.select("ticket_id", route=pl.col("body").str.to_lowercase())
    assert meta["result"].select("ticket_id", "route").equals(lower)


def test_failed_rows_are_not_stored(storage: Storage) -> None:
    def sometimes(batch: pl.DataFrame) -> pl.DataFrame:
        CALLED.extend(batch.get_column("body").to_list())
        if "ticket body 3" in batch.get_column("body").to_list():
            raise ValueError("cannot route ticket body 3")
        return batch.select("ticket_id", route=pl.col("body").str.to_uppercase())

    data = bodies(range(16))
    options = {"batch_size": 1, "max_attempts": 1, "max_failed_fraction": 0.5}
    run(storage, asset_of("first", sometimes, "tickets", **options), data)

    meta = run(
        storage,
        asset_of("first", sometimes, "tickets", **options),
        data,
        config={"checkpoint_tag": "again"},
    )

    assert CALLED == ["ticket body 3"]
    assert (meta["rows_from_store"], meta["rows_failed"]) == (15, 1)


def test_reuse_is_off_unless_asked_and_run_config_turns_it_off(storage: Storage) -> None:
    data = bodies(range(10))
    run(storage, asset_of("first", routed, "tickets", reuse=None), data)
    store = ResultStore(open_store(storage[0], storage[1]))
    assert store.files() == []  # the IO manager's reuse_results is off: nothing stored

    run(
        storage,
        asset_of("first", routed, "tickets", reuse=None),
        data,
        reuse_results=True,
        config={"checkpoint_tag": "stored"},
    )
    meta = run(
        storage,
        asset_of("first", routed, "tickets"),
        data,
        config={"checkpoint_tag": "off", "reuse": False},
    )

    assert (len(CALLED), meta["rows_from_store"]) == (10, 0)


def test_with_a_budget_the_metadata_says_what_reuse_saved(storage: Storage) -> None:
    budget = Budget({"small": {"input": 1.0, "output": 2.0}})
    columns = {"usage_columns": ["input_tokens", "output_tokens"], "budget": budget}
    data = bodies(range(10))
    computed = run(storage, asset_of("first", routed, "tickets", **columns), data)

    meta = run(storage, asset_of("second", routed, "tickets", **columns), data)

    assert meta["rows_from_store"] == 10
    assert meta["cost_saved_usd"] == pytest.approx(computed["cost_usd"])
    assert computed["cost_usd"] > 0


def answer(row: dict[str, Any], chat: OpenAIResource) -> dict[str, Any]:
    """One model request per row, through the resource's client."""
    messages: Any = [{"role": "user", "content": row["body"]}]
    reply = chat.sync_client().chat.completions.create(messages=messages, **chat.request_defaults())
    return {"route": reply.choices[0].message.content}


def test_the_endpoint_answers_only_rows_it_was_never_asked(tmp_path: Any) -> None:
    storage: Storage = (str(tmp_path / "checkpoints"), {})
    with serve() as base_url:
        chat = OpenAIResource(base_url=base_url, api_key="local", model="m", temperature=0.0)

        def served(asset: dg.AssetsDefinition, data: pl.DataFrame, **kw: Any) -> int:
            before = stats(base_url)["requests"]
            run(storage, asset, data, resources={"chat": chat}, **kw)
            return stats(base_url)["requests"] - before

        first = served(asset_of("first", answer, "tickets"), bodies(range(0, 40)))
        second = asset_of("second", answer, "other_tickets")
        overlap = served(second, bodies(range(20, 60)), source="other_tickets")
        new_tag = served(
            second,
            bodies(range(20, 60)),
            source="other_tickets",
            config={"checkpoint_tag": "again"},
        )
        renumbered = served(
            second,
            bodies(range(0, 60), offset=500),
            source="other_tickets",
            config={"checkpoint_tag": "renumbered"},
        )

    assert (first, overlap, new_tag, renumbered) == (40, 20, 0, 0)


def batch_request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


def batch_parse(body: dict[str, Any]) -> dict[str, Any]:
    return {"route": body["choices"][0]["message"]["content"]}


def test_a_provider_batch_asset_submits_only_rows_never_asked(tmp_path: Any) -> None:
    storage: Storage = (str(tmp_path / "checkpoints"), {})

    def batch_asset(name: str, source: str) -> dg.AssetsDefinition:
        return provider_batch_asset(
            name=name,
            source=source,
            id_column="ticket_id",
            input_columns=["body"],
            parse=batch_parse,
            provider="openai",
            reuse=True,
            poll_seconds=0.05,
            max_poll_seconds=0.2,
        )(batch_request)

    with serve_batches() as base_url:
        openai = OpenAIResource(base_url=base_url, api_key="local", model="m")
        first = run(
            storage,
            batch_asset("first", "tickets"),
            bodies(range(0, 40)),
            resources={"openai": openai},
        )
        submitted = batch_stats(base_url)["submitted"]
        second = run(
            storage,
            batch_asset("second", "other_tickets"),
            bodies(range(20, 60)),
            source="other_tickets",
            resources={"openai": openai},
        )
        again = batch_stats(base_url)["submitted"] - submitted

    assert (submitted, again) == (40, 20)
    assert (first["rows_from_store"], second["rows_from_store"]) == (0, 20)
    routes = second["result"].get_column("route")
    assert routes.null_count() == 0 and second["result"].height == 40
    manager = CheckpointIOManager(base_dir=storage[0])
    stored = manager.checkpoint(dg.AssetKey("second"), None, None).load("ticket_id").rows
    assert stored.get_column("_answer").null_count() == 0  # taken rows keep their answer


def test_another_shard_scheme_takes_its_results_from_the_store(storage: Storage) -> None:
    data = bodies(range(80))
    four = asset_of("first", routed, "tickets", partitions_def=shard_partitions(4))
    for key in shard_partitions(4).get_partition_keys():
        run(storage, four, data, partition_key=key)
    two = asset_of("second", routed, "tickets", partitions_def=shard_partitions(2))

    metas = [run(storage, two, data, partition_key=k) for k in ("0-of-2", "1-of-2")]

    assert CALLED == []
    assert sum(m["rows_from_store"] for m in metas) == 80
    both = pl.concat([m["result"] for m in metas]).sort("ticket_id")
    assert both.select("ticket_id", "route").equals(expected(data))


def test_an_empty_shard_with_reuse_stores_and_takes_nothing(storage: Storage) -> None:
    empty = bodies(range(5)).clear()

    meta = run(storage, asset_of("first", routed, "tickets"), empty)

    assert (meta["rows_from_store"], meta["rows_computed"], meta["result"].height) == (0, 0, 0)
