"""One request/parse definition, three ways to run it: ``online``, ``batch`` and ``hybrid``,
chosen per run in run config, through real Dagster materializations.

The batches go to the local batch provider, the online requests to the local chat server, both
on one base URL (``examples/llm_batch/online.py``), so one resource reaches either. Each counts
what it answered: the requests paid for are the provider's ``processed`` plus the chat server's
``ok``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import ASSET, stats, step_error

from checkpoint_assets import (
    AnthropicResource,
    CheckpointIOManager,
    OpenAIResource,
    provider_batch_asset,
    shard_partitions,
)
from checkpoint_assets.engine import Checkpoint, open_store
from checkpoint_assets.engine.fields import DOC, doc_of
from checkpoint_assets.engine.providers.answers import ANSWER
from checkpoint_assets.engine.providers.job import Way
from checkpoint_assets.integration.define.provider_asset import (
    ProviderArguments,
    ProviderBatchRunConfig,
)
from examples.llm_batch.jobs import Settings
from examples.llm_batch.online import Both, serve

ID = "ticket_id"
SHARD = "0-of-1"
TEXTS = ("I was charged twice, please refund me", "The app crashes with an error", "hello")


def openai_parse(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "answer": body["choices"][0]["message"]["content"],
        "input_tokens": body["usage"]["prompt_tokens"],
    }


def anthropic_parse(message: dict[str, Any]) -> dict[str, Any]:
    return {
        "answer": message["content"][0]["text"],
        "input_tokens": message["usage"]["input_tokens"],
    }


APIS = {
    "openai": (
        openai_parse,
        lambda url: OpenAIResource(base_url=url, api_key="local", model="m"),
    ),
    "anthropic": (
        anthropic_parse,
        lambda url: AnthropicResource(
            base_url=url.removesuffix("/v1"), api_key="local", model="claude-test", max_tokens=8
        ),
    ),
}


class Setup:
    def __init__(self, base_dir: str, url: str, servers: Both, rows: int, api: str) -> None:
        self.base_dir, self.url, self.servers, self.api = base_dir, url, servers, api
        self.df = pl.DataFrame({ID: list(range(rows)), "body": [TEXTS[i % 3] for i in range(rows)]})
        self.instance = dg.DagsterInstance.ephemeral()

    def asset(self, **kw: Any) -> dg.AssetsDefinition:
        options: dict[str, Any] = {
            "source": "tickets",
            "id_column": ID,
            "parse": APIS[self.api][0],
            "provider": self.api,
            "input_columns": ["body"],
            "partitions_def": shard_partitions(1),
            "usage_columns": ["input_tokens"],
            "poll_seconds": 0.05,
            "max_poll_seconds": 0.2,
            "max_concurrency": 8,
            "checkpoint_interval": 64,
        }

        @provider_batch_asset(name=ASSET, **(options | kw))
        def routed(row: dict[str, Any]) -> dict[str, Any]:
            """The same request, whichever way it is sent."""
            return {"messages": [{"role": "user", "content": row["body"]}]}

        return routed

    def materialize(self, a: dg.AssetsDefinition, **config: Any) -> dg.ExecuteInProcessResult:
        @dg.asset(name="tickets", io_manager_key="source_io")
        def tickets() -> pl.DataFrame:
            return self.df

        return dg.materialize(
            [tickets, a],
            instance=self.instance,
            resources={
                "io_manager": CheckpointIOManager(base_dir=self.base_dir),
                "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
                self.api: APIS[self.api][1](self.url),
            },
            partition_key=SHARD,
            run_config={"ops": {ASSET: {"config": config}}},
            raise_on_error=False,
        )

    def stored(self, tag: str = "default") -> pl.DataFrame:
        return Checkpoint(open_store(self.base_dir), f"{ASSET}/{tag}/{SHARD}").load(ID).rows

    def stored_once(self, tag: str = "default") -> None:
        """Every input row stored, in one row of one file: none twice."""
        checkpoint = Checkpoint(open_store(self.base_dir), f"{ASSET}/{tag}/{SHARD}")
        files = checkpoint.data_files()
        parts = pl.concat([pl.read_parquet(f).select(ID, "_error") for f in files])
        assert parts.height == parts.get_column(ID).n_unique() == self.df.height
        assert parts.get_column("_error").null_count() == self.df.height


@pytest.fixture
def setup(tmp_path: Any, request: pytest.FixtureRequest) -> Iterator[Setup]:
    marker = request.node.get_closest_marker("provider")
    options = dict(marker.kwargs) if marker else {}
    rows = options.pop("rows", 300)
    api = options.pop("api", "openai")
    with serve(Settings(**options)) as (url, both):
        yield Setup(str(tmp_path / "checkpoints"), url, both, rows, api)


def outputs(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.sort(ID).select(ID, "answer", "input_tokens", "_error")


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_one_definition_gives_the_same_outputs_online_and_as_batches(
    tmp_path: Any, api: str
) -> None:
    with serve(Settings()) as (url, both):
        setup = Setup(str(tmp_path / "checkpoints"), url, both, 120, api)
        asset = setup.asset()  # the asset's default mode: batch
        batched = setup.materialize(asset, checkpoint_tag="batched")
        online = setup.materialize(asset, checkpoint_tag="online", mode="online")
        assert batched.success and online.success
        assert both.provider.snapshot()["processed"] == 120  # the batch run's requests
        assert both.chat.snapshot()["ok"] == 120  # the online run's, one each
    by_batch, by_request = setup.stored("batched"), setup.stored("online")
    assert outputs(by_request).equals(outputs(by_batch))
    assert outputs(by_request).get_column("answer").head(3).to_list() == [
        "billing",
        "technical",
        "other",
    ]
    # Each row keeps the provider's response body it was parsed from, whichever way it came.
    for frame in (by_batch, by_request):
        first = json.loads(frame.sort(ID).get_column(ANSWER)[0])
        assert APIS[api][0](first)["answer"] == "billing"
    meta = stats(online)
    assert (meta["mode"], meta["rows_online"], meta["rows_computed"]) == ("online", 120, 120)
    assert stats(batched)["mode"] == "batch" and stats(batched)["rows_online"] == 0


@pytest.mark.provider(rows=400, processing_delay=6.0)
def test_a_hybrid_run_past_its_deadline_stores_every_row_once_and_pays_each_once(
    setup: Setup,
) -> None:
    # The batch would take 6 s; at 0.5 s it is cancelled and its rows without a result go online.
    result = setup.materialize(setup.asset(), mode="hybrid", deadline="0.5s")
    assert result.success, step_error(result)
    provider, chat = setup.servers.provider.snapshot(), setup.servers.chat.snapshot()
    assert provider["cancels"] == 1
    assert provider["processed"] > 0 and provider["cancelled"] > 0  # some by batch, the rest not
    assert provider["processed"] + provider["cancelled"] == 400
    assert setup.servers.paid() == 400  # no row paid twice
    setup.stored_once()
    meta = stats(result)
    assert meta["mode"] == "hybrid"
    assert meta["rows_online"] == chat["ok"] == provider["cancelled"]
    assert meta["batch_results_dropped"] == 0
    assert meta["rows_computed"] == 400


@pytest.mark.provider(rows=200, expire_rate=1.0, expire_after=0.0)
def test_a_hybrid_run_finishes_an_expired_batch_online_without_a_deadline(setup: Setup) -> None:
    result = setup.materialize(setup.asset(mode="hybrid"))  # the asset's default this time
    assert result.success, step_error(result)
    provider = setup.servers.provider.snapshot()
    assert provider["creates"] == 1 and provider["expired"] == 200  # nothing sent again as batch
    assert setup.servers.paid() == 200
    setup.stored_once()
    assert stats(result)["rows_online"] == 200


@pytest.mark.provider(rows=200, processing_delay=3600.0)
def test_an_online_run_cancels_the_pending_batches_of_an_earlier_run_first(setup: Setup) -> None:
    asset = setup.asset()
    submitted = setup.materialize(asset, wait=False)  # submits and ends: the batch waits
    assert not submitted.success
    assert setup.servers.provider.snapshot()["submitted"] == 200
    result = setup.materialize(asset, mode="online")
    assert result.success, step_error(result)
    provider = setup.servers.provider.snapshot()
    assert provider["cancels"] == 1 and provider["processed"] == 0
    assert setup.servers.paid() == 200  # nothing paid twice: the batch ran nothing
    setup.stored_once()
    assert stats(result)["rows_online"] == 200


@pytest.mark.provider(rows=10)
def test_a_bad_mode_or_deadline_is_a_clear_error(setup: Setup) -> None:
    asset = setup.asset()
    for config, said in (
        ({"mode": "fast"}, "mode must be one of online, batch, hybrid, got 'fast'"),
        ({"mode": "hybrid", "deadline": "soon"}, "deadline must be seconds or a duration"),
        ({"mode": "hybrid", "wait": False}, "mode hybrid finishes rows online in the run"),
        ({"deadline": 60}, "only mode hybrid follows, but this run's mode is batch"),
    ):
        result = setup.materialize(asset, **config)
        assert not result.success
        assert said in step_error(result)
    assert setup.servers.provider.snapshot()["submitted"] == 0  # nothing was sent
    with pytest.raises(ValueError, match="mode must be one of online, batch, hybrid"):
        setup.asset(mode="fast")


def test_the_assets_arguments_and_run_config_keep_one_set_of_rules() -> None:
    """Mode, deadline and wait: the decorator's arguments and the run config alone are read by
    ``Way.of`` (a run's config over the asset's: ``test_a_bad_mode_or_deadline_is_a_clear_error``),
    with the same defaults and meanings."""

    def asset(**arguments: Any) -> dg.AssetsDefinition:
        @provider_batch_asset(source="tickets", id_column=ID, parse=openai_parse, **arguments)
        def routed(row: dict[str, Any]) -> dict[str, Any]:
            return {"messages": [{"role": "user", "content": row["body"]}]}

        return routed

    for written, said in (
        ({"mode": "fast"}, "mode must be one of online, batch, hybrid, got 'fast'"),
        ({"mode": "hybrid", "deadline": "soon"}, "deadline must be seconds or a duration"),
        ({"mode": "hybrid", "deadline": -1}, "deadline must be at least 0 seconds"),
        ({"mode": "hybrid", "wait": False}, "mode hybrid finishes rows online in the run"),
    ):
        with pytest.raises(ValueError, match=said):
            asset(**written)
        with pytest.raises(ValueError, match=said):
            ProviderBatchRunConfig(**written)
    # Alone, a deadline stands for the hybrid runs: the asset's for those run config makes
    # hybrid, a run config's over an asset whose mode is hybrid.
    asset(deadline="15m")
    assert ProviderBatchRunConfig(deadline="15m").deadline == "15m"
    arguments = {f.name: f for f in fields(ProviderArguments)}
    for key, name in (("mode", "mode"), ("deadline", "deadline_seconds"), ("wait", "wait")):
        meaning = doc_of(Way, name)
        assert arguments[key].metadata[DOC].startswith(meaning)
        assert str(ProviderBatchRunConfig.model_fields[key].description).startswith(meaning)
        default = getattr(Way(), name)
        assert arguments[key].default == getattr(default, "value", default)


@pytest.mark.provider(rows=200, error_rate=0.2)
def test_a_hybrid_run_sends_requests_that_failed_in_a_transient_way_online(setup: Setup) -> None:
    result = setup.materialize(setup.asset(), mode="hybrid")
    assert result.success, step_error(result)
    provider, chat = setup.servers.provider.snapshot(), setup.servers.chat.snapshot()
    assert provider["creates"] == 1  # none sent again as a batch
    assert provider["errored"] > 0 and chat["ok"] == provider["errored"]
    setup.stored_once()
    assert stats(result)["rows_online"] == provider["errored"]


@pytest.mark.provider(rows=10)
def test_an_endpoint_the_resource_cannot_send_online_is_a_clear_error(setup: Setup) -> None:
    result = setup.materialize(setup.asset(endpoint="chat/completions"), mode="online")
    assert not result.success
    assert "OpenAI's endpoints are API paths that start with /v1/" in step_error(result)
    assert setup.servers.chat.snapshot()["requests"] == 0


def department(body: dict[str, Any]) -> dict[str, Any]:
    """``openai_parse``, refusing the answer ``other``."""
    out = openai_parse(body)
    if out["answer"] == "other":
        raise ValueError("no department")
    return out


def shouted(body: dict[str, Any]) -> dict[str, Any]:
    """A changed parse: the department in capitals."""
    out = openai_parse(body)
    return {**out, "answer": out["answer"].upper()}


@pytest.mark.provider(rows=30)
def test_online_answers_are_kept_so_a_failed_or_changed_parse_asks_nothing_again(
    setup: Setup,
) -> None:
    first = setup.materialize(
        setup.asset(parse=department, retry_delay_seconds=0.0, max_failed_fraction=1.0),
        mode="online",
    )
    assert first.success, step_error(first)
    assert setup.servers.chat.snapshot()["ok"] == 30  # a parse that raised asked once, not 3 times
    stored = setup.stored().sort(ID)
    failed = stored.filter(pl.col("_error").is_not_null())
    assert failed.height == 10  # every third text answers "other"
    assert failed.get_column("_error")[0] == "parse() raised ValueError: no department"
    assert stored.get_column(ANSWER).null_count() == 0  # the failed rows keep their answer
    changed = setup.materialize(setup.asset(parse=shouted), mode="online")
    assert changed.success, step_error(changed)
    assert setup.servers.chat.snapshot()["ok"] == 30  # parsed again from the answers
    stored = setup.stored().sort(ID)
    assert stored.get_column("answer").head(3).to_list() == ["BILLING", "TECHNICAL", "OTHER"]
    assert stored.get_column("_error").null_count() == 30


@pytest.mark.provider(rows=10)
def test_a_request_that_raises_online_stops_the_shard_as_in_a_batch(setup: Setup) -> None:
    def broken(row: dict[str, Any]) -> dict[str, Any]:
        raise KeyError("subject")

    asset = provider_batch_asset(
        name=ASSET,
        source="tickets",
        id_column=ID,
        parse=openai_parse,
        provider="openai",
        partitions_def=shard_partitions(1),
    )(broken)
    result = setup.materialize(asset, mode="online")
    assert not result.success
    assert "request() raised KeyError: 'subject' for the row 0" in step_error(result)
    assert setup.servers.chat.snapshot()["requests"] == 0
