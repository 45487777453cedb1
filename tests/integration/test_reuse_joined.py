"""The result store joined to the dry run's estimate and to kept answers (issue 35).

The estimate counts the rows the store would give, so its figures meet the real run's. A
request/parse job that keeps its answers is keyed by its request alone: a second asset with
another ``parse`` takes the stored answers and parses them, with no request. Real Dagster
materializations on real files; requests are counted on the servers' side: the local batch
provider (``examples/llm_batch/provider.py``), and beside it the chat server for online runs
(``examples/llm_batch/online.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pytest

from checkpoint_assets import (
    CheckpointIOManager,
    OpenAIResource,
    checkpointed_asset,
    provider_batch_asset,
)
from checkpoint_assets.engine.plan.estimate import Estimate
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.storage import open_store
from checkpoint_assets.integration import metadata as md
from examples.llm_batch.online import serve as serve_both
from examples.llm_batch.provider import Settings, serve
from examples.llm_batch.provider import stats as provider_stats

ID = "ticket_id"
CALLED: list[str] = []  # the bodies the plain function was called with, across assets
TEXTS = ("I was charged twice, please refund me", "The app crashes with an error", "hello")
ROUTES = ("billing", "technical", "other")  # the local provider's answer for each of TEXTS


def tickets(ids: range) -> pl.DataFrame:
    """Tickets ``ids``; a body depends on its id only, so overlapping tables share rows."""
    return pl.DataFrame({ID: list(ids), "body": [TEXTS[i % 3] + f" #{i}" for i in ids]})


class Assets:
    """Assets over tables on one checkpoint root and one real instance."""

    def __init__(self, tmp_path: Path, url: str = "") -> None:
        self.base_dir = str(tmp_path / "checkpoints")
        self.instance = dg.DagsterInstance.ephemeral()
        self.url = url

    def run(
        self,
        asset: dg.AssetsDefinition,
        data: pl.DataFrame,
        source: str,
        raise_on_error: bool = True,
        **config: Any,
    ) -> dg.ExecuteInProcessResult:
        CALLED.clear()

        @dg.asset(name=source, io_manager_key="source_io")
        def table() -> pl.DataFrame:
            return data

        return dg.materialize(
            [table, asset],
            instance=self.instance,
            resources={
                "io_manager": CheckpointIOManager(base_dir=self.base_dir),
                "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
                "openai": OpenAIResource(base_url=self.url or "http://x", api_key="k", model="m"),
            },
            run_config={"ops": {asset.key.path[-1]: {"config": config}}} if config else None,
            raise_on_error=raise_on_error,
        )

    def materialized(self, *args: Any, **config: Any) -> dict[str, Any]:
        """The metadata of a materialization, and its output under ``result``."""
        result = self.run(*args, **config)
        name = args[0].key.path[-1]
        (event,) = result.asset_materializations_for_node(name)
        values = {k: md.plain(v) for k, v in event.metadata.items()}
        return values | {"result": result.output_for_node(name).sort(ID)}

    def estimate(self, *args: Any, **config: Any) -> Estimate:
        """A dry run's estimate, read from the observation it recorded."""
        result = self.run(*args, dry_run=True, **config)
        (event,) = result.get_asset_observation_events()
        observation = event.asset_observation_data.asset_observation
        return md.estimate_of({k: md.plain(v) for k, v in observation.metadata.items()})

    def store_files(self) -> list[str]:
        return [f.path for f in ResultStore(open_store(self.base_dir)).files()]


def routed(batch: pl.DataFrame) -> pl.DataFrame:
    CALLED.extend(batch.get_column("body").to_list())
    return batch.select(ID, route=pl.col("body").str.to_uppercase())


def plain_asset(name: str, source: str, **kw: Any) -> dg.AssetsDefinition:
    options: dict[str, Any] = {"input_columns": ["body"], "reuse": True, "checkpoint_interval": 8}
    return checkpointed_asset(source=source, id_column=ID, name=name, **(options | kw))(routed)


def test_the_estimate_counts_the_rows_the_store_gives_and_meets_the_real_run(
    tmp_path: Path,
) -> None:
    assets = Assets(tmp_path)
    assets.materialized(plain_asset("first", "tickets"), tickets(range(0, 40)), "tickets")
    files = assets.store_files()
    second, table = plain_asset("second", "other_tickets"), tickets(range(20, 70))

    found = assets.estimate(second, table, "other_tickets")
    off = assets.estimate(second, table, "other_tickets", reuse=False)
    assert assets.store_files() == files  # the dry runs read the store and wrote nothing
    assert (found.rows_total, found.rows_reused, found.rows_to_compute) == (50, 20, 30)
    assert (off.rows_reused, off.rows_to_compute) == (0, 50)

    # A run of the first 30 rows: 20 in the store, 10 new.
    limited = assets.estimate(second, table, "other_tickets", limit=30)
    done = assets.materialized(second, table, "other_tickets", limit=30)
    assert limited.rows_reused == done["rows_from_store"] == 20
    assert limited.rows_to_compute == done["rows_computed"] == len(CALLED) == 10

    # The rest: resume counts what that run did, and the store has none of the rows left.
    rest = assets.estimate(second, table, "other_tickets")
    done = assets.materialized(second, table, "other_tickets")
    assert (rest.rows_done, rest.rows_reused) == (30, 0)
    assert rest.rows_to_compute == done["rows_computed"] == len(CALLED) == 20
    assert sorted(CALLED) == sorted(tickets(range(50, 70)).get_column("body"))

    # A new tag: every row is in the store, and the estimate says so before the run.
    again = assets.estimate(second, table, "other_tickets", checkpoint_tag="again")
    retagged = assets.materialized(second, table, "other_tickets", checkpoint_tag="again")
    assert (again.rows_reused, again.rows_to_compute) == (50, 0)
    assert (retagged["rows_from_store"], retagged["rows_computed"], CALLED) == (50, 0, [])


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


def parse(body: dict[str, Any]) -> dict[str, Any]:
    return {"route": body["choices"][0]["message"]["content"]}


def parse_upper(body: dict[str, Any]) -> dict[str, Any]:
    return {"route": body["choices"][0]["message"]["content"].upper()}


def parse_strict(body: dict[str, Any]) -> dict[str, Any]:
    route = body["choices"][0]["message"]["content"]
    if route == "other":
        raise ValueError("no route")
    return {"route": route}


def batch_asset(name: str, source: str, **kw: Any) -> dg.AssetsDefinition:
    options: dict[str, Any] = {
        "parse": parse,
        "input_columns": ["body"],
        "reuse": True,
        "poll_seconds": 0.05,
        "max_poll_seconds": 0.2,
        "max_failed_fraction": 1.0,
    }
    arguments = options | kw
    return provider_batch_asset(name=name, source=source, id_column=ID, **arguments)(request)


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[Assets]:
    with serve(Settings()) as url:
        yield Assets(tmp_path, url)


def requested(assets: Assets) -> int:
    """Requests the local provider was sent, over every run so far."""
    return int(provider_stats(assets.url)["submitted"])


def test_another_parse_takes_the_stored_answers_with_no_request(provider: Assets) -> None:
    table = tickets(range(60))
    provider.materialized(batch_asset("first", "tickets"), table, "tickets")
    assert requested(provider) == 60
    upper = batch_asset("second", "tickets", parse=parse_upper)

    found = provider.estimate(upper, table, "tickets")
    done = provider.materialized(upper, table, "tickets")

    assert requested(provider) == 60  # counted on the provider's side: no request
    assert found.rows_reused == done["rows_from_store"] == 60
    assert found.rows_to_compute == done["rows_computed"] == 0
    routes = [ROUTES[i % 3].upper() for i in range(60)]
    assert done["result"].get_column("route").to_list() == routes  # the new parse's
    stored = CheckpointIOManager(base_dir=provider.base_dir).checkpoint(
        dg.AssetKey("second"), None, None
    )
    assert stored.load(ID).rows.get_column("_answer").null_count() == 0  # answers kept


def test_a_parse_that_raises_on_a_stored_answer_fails_that_row_with_its_text(
    provider: Assets,
) -> None:
    table = tickets(range(30))
    provider.materialized(batch_asset("first", "tickets"), table, "tickets")

    done = provider.materialized(
        batch_asset("second", "tickets", parse=parse_strict), table, "tickets"
    )

    assert requested(provider) == 30 and done["rows_from_store"] == 30
    result = done["result"]
    failed = result.filter(pl.col("_error").is_not_null())
    assert failed.get_column(ID).to_list() == list(range(2, 30, 3))
    assert set(failed.get_column("_error")) == {"parse() raised ValueError: no route"}
    assert result.get_column("route").null_count() == failed.height
    # Fixed: the failed rows are parsed again, still with no request.
    fixed = provider.materialized(batch_asset("second", "tickets"), table, "tickets")
    assert requested(provider) == 30 and fixed["result"].get_column("_error").null_count() == 30


def test_without_kept_answers_the_key_covers_parse_and_another_parse_asks_again(
    provider: Assets,
) -> None:
    table = tickets(range(30))
    provider.materialized(batch_asset("first", "tickets", keep_answers=False), table, "tickets")
    same = batch_asset("same", "tickets", keep_answers=False)
    other = batch_asset("other", "tickets", keep_answers=False, parse=parse_upper)

    reused = provider.materialized(same, table, "tickets")
    assert requested(provider) == 30 and reused["rows_from_store"] == 30
    asked = provider.materialized(other, table, "tickets")

    assert requested(provider) == 60 and asked["rows_from_store"] == 0  # no stale outputs
    routes = [ROUTES[i % 3].upper() for i in range(30)]
    assert asked["result"].get_column("route").to_list() == routes


def test_answers_stored_online_serve_a_batch_run_with_another_parse(tmp_path: Path) -> None:
    table = tickets(range(40))
    with serve_both() as (url, both):
        assets = Assets(tmp_path, url)
        online = assets.materialized(
            batch_asset("first", "tickets"), table, "tickets", mode="online"
        )
        assert online["rows_computed"] == both.paid() == 40
        upper = batch_asset("second", "tickets", parse=parse_upper)

        done = assets.materialized(upper, table, "tickets", mode="batch")

        assert both.paid() == 40 and done["rows_from_store"] == 40  # counted on the servers
    routes = [ROUTES[i % 3].upper() for i in range(40)]
    assert done["result"].get_column("route").to_list() == routes
