"""Provider batches through real Dagster materializations against the local batch provider
(``examples/llm_batch/provider.py``), through OpenAI's Batch API (the real ``openai`` client over
HTTP; the provider counts every call and every request it processed): what does not depend on
the provider. What every provider must hold is the contract suite's
(``test_provider_contract.py``).

Failed requests at the last attempt retried on the next run; spend budgets that stop submissions
(their estimate reserved before anything is sent) and price results at the batch discount; the
arguments a request/parse asset shares with every checkpointed asset; the sensor's provider."""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Iterator
from dataclasses import MISSING, fields
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import ASSET, ids_in_shard, stats, step_error

from checkpoint_assets import (
    Budget,
    CheckpointError,
    CheckpointIOManager,
    OpenAIResource,
    Price,
    checkpointed_asset,
    provider_batch_asset,
    provider_batches_sensor,
    shard_partitions,
)
from checkpoint_assets.engine import Checkpoint, open_store
from checkpoint_assets.engine.providers.job import ProviderJob
from checkpoint_assets.engine.providers.submissions import Limits, Request
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.define.arguments import CommonArguments
from checkpoint_assets.integration.watch.spend import STOPPED_BY_TAG
from checkpoint_assets.resources.openai_batches import OpenAIBatches
from examples.llm_batch.jobs import ManualClock, Settings
from examples.llm_batch.provider import serve
from examples.llm_batch.provider import stats as provider_stats

ID = "ticket_id"
SHARD = "0-of-1"
TEXTS = ("I was charged twice, please refund me", "The app crashes with an error", "hello")


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


def parse(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "answer": body["choices"][0]["message"]["content"],
        "input_tokens": body["usage"]["prompt_tokens"],
    }


def tickets(n: int) -> pl.DataFrame:
    return pl.DataFrame({ID: list(range(n)), "body": [TEXTS[i % 3] for i in range(n)]})


class SmallBatches(OpenAIResource):
    """``OpenAIResource`` whose batches hold at most ``max_requests`` requests each."""

    max_requests: int = 100

    def batch_provider(self, endpoint: str | None = None) -> OpenAIBatches:
        api = super().batch_provider(endpoint)
        api.limits = Limits(self.max_requests, api.limits.max_bytes)
        return api


class Setup:
    def __init__(self, base_dir: str, url: str, rows: int, clock: ManualClock) -> None:
        self.base_dir, self.url, self.clock = base_dir, url, clock
        self.df = tickets(rows)
        self.instance = dg.DagsterInstance.ephemeral()
        self.resource = OpenAIResource(base_url=url, api_key="local", model="m")

    def asset(self, **kw: Any) -> dg.AssetsDefinition:
        options: dict[str, Any] = {
            "source": "tickets",
            "id_column": ID,
            "parse": parse,
            "provider": "openai",
            "input_columns": ["body"],
            "partitions_def": shard_partitions(1),
            "usage_columns": ["input_tokens"],
            "poll_seconds": 0.05,
            "max_poll_seconds": 0.2,
        }

        @provider_batch_asset(name=ASSET, **(options | kw))
        def routed(row: dict[str, Any]) -> dict[str, Any]:
            return request(row)

        return routed

    def resources(self) -> dict[str, Any]:
        return {
            "io_manager": CheckpointIOManager(base_dir=self.base_dir),
            "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
            "openai": self.resource,
        }

    def source(self) -> dg.AssetsDefinition:
        @dg.asset(name="tickets", io_manager_key="source_io")
        def tickets_asset() -> pl.DataFrame:
            return self.df

        return tickets_asset

    def materialize(
        self, a: dg.AssetsDefinition, partition: str = SHARD, **kw: Any
    ) -> dg.ExecuteInProcessResult:
        return dg.materialize(
            [self.source(), a],
            instance=self.instance,
            resources=self.resources(),
            partition_key=partition,
            **kw,
        )

    def provider(self) -> dict[str, int]:
        """What the provider counted: calls by kind, requests processed (paid)."""
        return provider_stats(self.url)

    def pending(self) -> list[str]:
        """The batches the last observation of the asset says are pending."""
        observation = self.instance.fetch_observations(dg.AssetKey(ASSET), limit=1).records[0]
        assert observation.asset_observation is not None
        pending = observation.asset_observation.metadata["batches_pending"].value
        return list(json.loads(str(pending)))

    def checkpoint(self, partition: str = SHARD) -> Checkpoint:
        return Checkpoint(open_store(self.base_dir), f"{ASSET}/default/{partition}")

    def stored(self, partition: str = SHARD) -> pl.DataFrame:
        return self.checkpoint(partition).load(ID).rows

    def parts(self) -> pl.DataFrame:
        """Every row of every part and merged file, unresolved: a row stored twice shows."""
        files = self.checkpoint().data_files()
        return pl.concat([pl.read_parquet(f).select(ID, "_error") for f in files])

    def stored_once(self) -> None:
        parts = self.parts()
        assert parts.height == parts.get_column(ID).n_unique() == self.df.height


@pytest.fixture
def setup(tmp_path: Any, request: pytest.FixtureRequest) -> Iterator[Setup]:
    marker = request.node.get_closest_marker("provider")
    options = dict(marker.kwargs) if marker else {}
    rows = options.pop("rows", 2_000)
    manual = options.pop("manual_clock", False)  # the provider's time moves only when told
    clock = ManualClock()
    with serve(Settings(**options), clock=clock if manual else time.time) as url:
        yield Setup(str(tmp_path / "checkpoints"), url, rows, clock)


@pytest.mark.provider(error_rate=0.05, processing_delay=0.1)
def test_transient_errors_at_the_last_attempt_are_failed_rows_retried_on_the_next_run(
    setup: Setup,
) -> None:
    asset = setup.asset(max_failed_fraction=0.2, max_attempts=1)
    first = setup.materialize(asset)
    failed = stats(first)["rows_failed"]
    assert 40 < failed < 180  # about 5 % of 2,000, none sent again
    assert setup.provider()["submitted"] == 2_000 and setup.provider()["creates"] == 1
    errors = setup.stored().filter(pl.col("_error").is_not_null())
    assert errors.get_column("_error").str.starts_with("HTTP 500").all()
    second = setup.materialize(asset)
    assert stats(second)["rows_computed"] == failed  # only the failed rows are submitted again
    assert setup.provider()["submitted"] == setup.provider()["processed"] == 2_000 + failed
    assert stats(second)["rows_failed"] < failed


# Spend budgets. The resource asks for at most 10 output tokens a row; the price is 1 and 2 USD
# per million input and output tokens, half of it through the batch API.
PRICE = Price(input=1.0, output=2.0)
MAX_TOKENS = 10


def priced_parse(body: dict[str, Any]) -> dict[str, Any]:
    usage = body["usage"]
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
    }


def priced_asset(setup: Setup, **kw: Any) -> dg.AssetsDefinition:
    budget = Budget({"m": PRICE}, input_tokens="prompt_tokens", output_tokens="completion_tokens")
    options = {"parse": priced_parse, "usage_columns": ["prompt_tokens", "completion_tokens"]}
    return setup.asset(**(options | {"budget": budget} | kw))


def small_batches(setup: Setup) -> None:
    """Batches of 100 requests, and rows whose requests are all the same size."""
    setup.resource = SmallBatches(base_url=setup.url, api_key="local", model="m", max_tokens=10)
    setup.df = setup.df.with_columns(
        body=pl.format("ticket {}", pl.col(ID).cast(pl.String).str.zfill(4))
    )


def submission_estimate(setup: Setup, rows: int = 100) -> float:
    """What a submission of ``rows`` requests is estimated to cost, by the documented rule:
    its bytes / 4 input tokens, ``max_tokens`` output tokens a row, at the batch price."""
    api = setup.resource.batch_provider()
    tag = "ca" + "0" * 32
    size = api.size(Request(f"{tag}-10", request({"body": "ticket 0000"})))
    return rows * (size / 4 * PRICE.input + MAX_TOKENS * PRICE.output) / 1e6 * 0.5


def batch_cost(tokens: dict[str, int]) -> float:
    """The batch price of the tokens the provider counted."""
    usd = tokens["input_tokens"] * PRICE.input + tokens["output_tokens"] * PRICE.output
    return usd / 1e6 * (1 - PRICE.batch_discount)


@pytest.mark.provider(rows=400, openai_max_requests=100)
def test_a_run_budget_stops_submissions_and_a_raised_limit_submits_only_the_rest(
    setup: Setup,
) -> None:
    small_batches(setup)
    limit = 2.5 * submission_estimate(setup)  # two submissions of 100 rows fit, not a third
    routed = priced_asset(setup)
    stopped = setup.materialize(routed, raise_on_error=False, run_config=_limit(max_run_cost=limit))
    assert not stopped.success
    # The two submitted were collected and stored; the other 200 rows were never sent.
    assert setup.provider()["creates"] == 2
    assert setup.provider()["submitted"] == setup.provider()["processed"] == 200
    assert setup.stored().height == 200
    error = step_error(stopped)
    assert error.startswith("BudgetExceededError") and f"max_run_cost is {limit:.4f} USD" in error
    spent = batch_cost(setup.provider())
    assert f"this run has spent {spent:.4f} USD" in error
    assert "nothing more was submitted" in error and "collected and stored" in error
    assert "budget: {max_run_cost: <USD>}" in error
    run = setup.instance.get_run_by_id(stopped.run_id)
    assert run is not None and run.tags[STOPPED_BY_TAG] == "budget"  # the sensor leaves it

    done = setup.materialize(routed, run_config=_limit(max_run_cost=1.0))
    assert stats(done)["rows_computed"] == 200  # only the rest was submitted
    assert setup.provider()["creates"] == 4 and setup.provider()["processed"] == 400
    parts = setup.parts()
    assert parts.height == 400 and parts.get_column(ID).n_unique() == 400


@pytest.mark.provider(rows=400, openai_max_requests=100, processing_delay=600, manual_clock=True)
def test_a_budget_stop_of_a_run_that_submits_and_ends_leaves_its_submissions_to_the_next_run(
    setup: Setup,
) -> None:
    small_batches(setup)
    routed = priced_asset(setup, wait=False)
    limit = 2.5 * submission_estimate(setup)
    stopped = setup.materialize(routed, raise_on_error=False, run_config=_limit(max_run_cost=limit))
    error = step_error(stopped)
    assert error.startswith("BudgetExceededError") and "nothing more was submitted" in error
    assert "are reserved for the 200 row(s) submitted and not collected yet" in error
    assert setup.provider()["submitted"] == 200 and setup.provider()["processed"] == 0

    # Raised, the next run collects those two (ended by now) and submits only the rest.
    setup.clock.advance(601)
    raised = _limit(max_run_cost=1.0)
    assert not setup.materialize(routed, raise_on_error=False, run_config=raised).success
    assert setup.provider()["creates"] == 4 and setup.stored().height == 200
    setup.clock.advance(601)
    assert setup.materialize(routed, run_config=raised).success
    assert setup.provider()["submitted"] == setup.provider()["processed"] == 400
    assert setup.parts().get_column(ID).n_unique() == setup.parts().height == 400


@pytest.mark.provider(rows=300)
def test_results_of_provider_batches_cost_the_batch_price(setup: Setup) -> None:
    result = setup.materialize(priced_asset(setup))
    tokens = setup.provider()
    (event,) = result.asset_materializations_for_node(ASSET)
    cost = event.metadata[md.COST_USD].value
    per_row = (tokens["input_tokens"] * PRICE.input + tokens["output_tokens"] * PRICE.output) / 1e6
    assert per_row > 0 and cost == pytest.approx(per_row / 2)  # half the per-row price
    assert event.metadata[md.COST_ASSET_TOTAL_USD].value == pytest.approx(per_row / 2)


@pytest.mark.provider(rows=400, openai_max_requests=100)
def test_an_asset_budget_spans_shards_and_stops_the_second_shards_submissions(
    setup: Setup,
) -> None:
    small_batches(setup)
    shards = shard_partitions(2)
    routed = priced_asset(setup, partitions_def=shards)
    first = setup.materialize(routed, partition="0-of-2")
    (event,) = first.asset_materializations_for_node(ASSET)
    first_cost = float(event.metadata[md.COST_USD].value)
    rows = [len(ids_in_shard(setup.df, s, 2)) for s in range(2)]
    assert setup.provider()["processed"] == rows[0] and rows[1] > 100

    # Shard 0's cost, then room for one submission of shard 1, not two.
    limit = first_cost + 1.5 * submission_estimate(setup)
    stopped = setup.materialize(
        routed, partition="1-of-2", raise_on_error=False, run_config=_limit(max_asset_cost=limit)
    )
    assert not stopped.success
    assert setup.provider()["processed"] == rows[0] + 100
    assert setup.stored("1-of-2").height == 100
    error = step_error(stopped)
    assert f"max_asset_cost is {limit:.4f} USD and the asset (every shard and run)" in error
    assert f"has spent {batch_cost(setup.provider()):.4f} USD" in error
    run = setup.instance.get_run_by_id(stopped.run_id)
    assert run is not None and run.tags[STOPPED_BY_TAG] == "budget"


def _limit(**limits: float) -> dict[str, Any]:
    return {"ops": {ASSET: {"config": {"budget": limits}}}}


def test_every_argument_every_checkpointed_asset_takes_is_one_of_provider_batch_asset() -> None:
    parameters = inspect.signature(provider_batch_asset).parameters
    for field in fields(CommonArguments):
        default = inspect.Parameter.empty if field.default is MISSING else field.default
        assert parameters[field.name].kind is inspect.Parameter.KEYWORD_ONLY, field.name
        assert parameters[field.name].default == default, field.name
    # A waiting run polls as the engine's ProviderJob does unless told otherwise.
    assert parameters["poll_seconds"].default == ProviderJob.poll_seconds
    assert parameters["max_poll_seconds"].default == ProviderJob.max_poll_seconds


@pytest.mark.provider(rows=300)
def test_shared_arguments_reach_the_asset_and_its_runs(setup: Setup) -> None:
    days = ["2026-01-01", "2026-01-02"]

    @dg.asset(name="tickets", partitions_def=dg.StaticPartitionsDefinition(days))
    def daily(context) -> pl.DataFrame:  # type: ignore[no-untyped-def]
        return setup.df.filter(pl.col(ID) % 2 == days.index(context.partition_key))

    condition = dg.AutomationCondition.eager()
    routed = setup.asset(
        source_partition_mapping=dg.AllPartitionMapping(),  # one shard over both days
        owners=["team:ml"],
        kinds=["batch"],
        op_tags={"queue": "batch"},
        retry_policy=dg.RetryPolicy(max_retries=2),
        automation_condition=condition,
    )
    spec = next(iter(routed.specs))
    assert spec.owners == ["team:ml"] and spec.automation_condition == condition
    assert spec.kinds == {"polars", "parquet", "openai", "batch"}
    assert routed.op.tags["queue"] == "batch"
    assert routed.op.retry_policy == dg.RetryPolicy(max_retries=2)
    resources = setup.resources()
    for day in days:
        assert dg.materialize([daily], partition_key=day, resources=resources).success
    result = dg.materialize(
        [daily, routed],
        selection=[routed.key],
        partition_key=SHARD,
        instance=setup.instance,
        resources=resources,
    )
    assert result.success
    assert stats(result)["rows_computed"] == 300  # the rows of both days
    assert setup.provider()["submitted"] == 300


def test_the_sensor_reads_the_provider_from_the_asset_and_names_the_call_without_it() -> None:
    routed = provider_batch_asset(
        source="tickets", id_column=ID, parse=parse, provider="claude", name=ASSET
    )(request)
    sensor = provider_batches_sensor(routed)
    assert sensor.required_resource_keys == {"claude"}
    with pytest.raises(TypeError, match=rf"call provider_batches_sensor\({ASSET}\) without"):
        provider_batches_sensor(routed, provider="claude")  # type: ignore[arg-type]

    @checkpointed_asset(source="tickets", id_column=ID)
    def computed(batch: pl.DataFrame) -> pl.DataFrame:
        return batch

    with pytest.raises(CheckpointError, match="use failed_partitions_sensor"):
        provider_batches_sensor(computed)
