"""Provider batches through real Dagster materializations against the local batch provider
(``examples/llm_batch/provider.py``), through OpenAI's Batch API and Anthropic's Message Batches
(the real ``openai`` and ``anthropic`` clients over HTTP; the provider counts every call and every
request it processed).

Through either API: a shard's rows submitted once and stored once, results stored like computed
rows, transient per-request errors sent again within the run (invalid requests failed at once),
expired and cancelled batches giving back their unrun rows with nothing paid twice, the
submit-and-end path with ``provider_batches_sensor`` requesting the collecting run. Through
OpenAI's: spend budgets that stop submissions (their estimate reserved before anything is sent)
and price results at the batch discount."""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import ASSET, ids_in_shard, stats, step_error

from checkpoint_assets import (
    AnthropicResource,
    Budget,
    CheckpointError,
    CheckpointIOManager,
    OpenAIResource,
    Price,
    checkpointed_asset,
    failed_partitions_sensor,
    provider_batch_asset,
    provider_batches_sensor,
    shard_partitions,
)
from checkpoint_assets.engine import Checkpoint, open_store
from checkpoint_assets.engine.providers.job import ProviderJob
from checkpoint_assets.engine.providers.submissions import Limits, Request
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.define.arguments import CommonArguments
from checkpoint_assets.integration.watch.pending import PENDING_TAG
from checkpoint_assets.integration.watch.spend import STOPPED_BY_TAG
from checkpoint_assets.resources.openai_batches import OpenAIBatches
from examples.llm_batch.jobs import ManualClock, Settings, expires
from examples.llm_batch.provider import serve
from examples.llm_batch.provider import stats as provider_stats

ID = "ticket_id"
SHARD = "0-of-1"
TEXTS = ("I was charged twice, please refund me", "The app crashes with an error", "hello")
ANSWERS = ("billing", "technical", "other")  # the provider's rule for each of TEXTS


@dataclass(frozen=True)
class Api:
    """What differs between the two batch APIs, for a test: ``name`` as ``jobs.expires`` says it,
    the resource key, the resource on the provider's base URL, how an answer is read (into
    ``answer`` and ``input_tokens``) and how a failed request's ``_error`` starts."""

    name: str
    key: str
    resource: Callable[[str], OpenAIResource | AnthropicResource]
    parse: Callable[[dict[str, Any]], dict[str, Any]]
    error: str


OPENAI = Api(
    "openai",
    "openai",
    lambda url: OpenAIResource(base_url=url, api_key="local", model="m"),
    lambda body: {
        "answer": body["choices"][0]["message"]["content"],
        "input_tokens": body["usage"]["prompt_tokens"],
    },
    "HTTP 500",
)
ANTHROPIC = Api(
    "anthropic",
    "claude",
    lambda url: AnthropicResource(
        base_url=url.removesuffix("/v1"), api_key="local", model="claude-test", max_tokens=8
    ),
    lambda message: {
        "answer": message["content"][0]["text"],
        "input_tokens": message["usage"]["input_tokens"],
    },
    "api_error: ",
)
#: A test through either API; a test without it runs through OpenAI's (the ``api`` fixture).
BOTH_APIS = pytest.mark.parametrize("api", [OPENAI, ANTHROPIC], ids=lambda a: a.name)


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


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
    def __init__(self, base_dir: str, url: str, rows: int, clock: ManualClock, api: Api) -> None:
        self.base_dir, self.url, self.clock, self.api = base_dir, url, clock, api
        self.df = tickets(rows)
        self.instance = dg.DagsterInstance.ephemeral()
        self.resource = api.resource(url)

    def asset(self, **kw: Any) -> dg.AssetsDefinition:
        options: dict[str, Any] = {
            "source": "tickets",
            "id_column": ID,
            "parse": self.api.parse,
            "provider": self.api.key,
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
            self.api.key: self.resource,
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
def api() -> Api:
    return OPENAI


@pytest.fixture
def setup(tmp_path: Any, request: pytest.FixtureRequest, api: Api) -> Iterator[Setup]:
    marker = request.node.get_closest_marker("provider")
    options = dict(marker.kwargs) if marker else {}
    rows = options.pop("rows", 2_000)
    manual = options.pop("manual_clock", False)  # the provider's time moves only when told
    if options.pop("first_batch_expires", False):
        options |= {"expire_rate": 0.5, "seed": _first_batch_expires(api.name)}
    clock = ManualClock()
    with serve(Settings(**options), clock=clock if manual else time.time) as url:
        yield Setup(str(tmp_path / "checkpoints"), url, rows, clock, api)


def _first_batch_expires(api: str) -> int:
    """A seed under which the first batch created through ``api`` expires and the next ones do
    not."""
    return next(
        seed
        for seed in range(1000)
        if [expires(Settings(expire_rate=0.5, seed=seed), api, n) for n in (1, 2, 3)]
        == [True, False, False]
    )


@contextmanager
def ticking(clock: ManualClock) -> Iterator[None]:
    """The provider's clock moving on by a second every 50 ms, for a run that waits."""
    done = threading.Event()

    def tick() -> None:
        while not done.wait(0.05):
            clock.advance(1.0)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@BOTH_APIS
@pytest.mark.provider(rows=20_000, processing_delay=0.3)
def test_a_shard_of_20000_rows_is_one_batch_stored_once(setup: Setup) -> None:
    result = setup.materialize(setup.asset())
    assert result.success
    provider = setup.provider()
    assert provider["creates"] == 1
    assert provider["submitted"] == provider["processed"] == provider["succeeded"] == 20_000
    setup.stored_once()
    stored = setup.stored().sort(ID)
    assert stored.get_column("answer").to_list()[:3] == list(ANSWERS)
    meta = stats(result)
    assert meta["rows_computed"] == 20_000
    # From the responses, like computed rows: the provider counts whitespace tokens.
    assert meta["usage/input_tokens"] == sum(len(TEXTS[i % 3].split()) for i in range(20_000))
    again = setup.materialize(setup.asset())
    assert again.success and setup.provider()["submitted"] == 20_000  # nothing left to do
    assert setup.provider()["creates"] == 1


@BOTH_APIS
@pytest.mark.provider(error_rate=0.05, processing_delay=0.1)
def test_transient_request_errors_are_sent_again_within_the_run(setup: Setup) -> None:
    # Rows 0 and 1 are invalid requests: the provider refuses them, and they are not sent again.
    def invalid_for_two(row: dict[str, Any]) -> dict[str, Any]:
        return {"messages": []} if row[ID] < 2 else request(row)

    asset = provider_batch_asset(
        name=ASSET,
        source="tickets",
        id_column=ID,
        parse=setup.api.parse,
        provider=setup.api.key,
        partitions_def=shard_partitions(1),
        max_failed_fraction=0.01,
        # At 5 % errors, some row of 2,000 fails all eight requests in under 1e-7 of runs.
        max_attempts=8,
        poll_seconds=0.05,
        max_poll_seconds=0.2,
    )(invalid_for_two)
    result = setup.materialize(asset)
    assert result.success  # one run: the failed requests went again in new batches
    provider = setup.provider()
    sent_again = provider["submitted"] - 2_000
    assert provider["creates"] >= 2 and 40 < sent_again < 180  # about 5 % of 2,000, then 5 % ...
    # Every request sent was answered once; only the transient errors were sent again.
    assert provider["processed"] == provider["submitted"]
    assert provider["errored"] == sent_again + 2  # ... and the two invalid requests, once each
    setup.stored_once()
    stored = setup.stored()
    failed = stored.filter(pl.col("_error").is_not_null())
    assert failed.get_column(ID).sort().to_list() == [0, 1]
    assert not failed.get_column("_error").str.starts_with(setup.api.error).any()
    assert stats(result)["rows_computed"] == 2_000 and stats(result)["rows_failed"] == 2
    # A row sent again counts each request it took.
    assert stored.get_column("_attempts").max() >= 2


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
    assert errors.get_column("_error").str.starts_with(setup.api.error).all()
    second = setup.materialize(asset)
    assert stats(second)["rows_computed"] == failed  # only the failed rows are submitted again
    assert setup.provider()["submitted"] == setup.provider()["processed"] == 2_000 + failed
    assert stats(second)["rows_failed"] < failed


@BOTH_APIS
@pytest.mark.provider(first_batch_expires=True, expire_after=0.2, processing_delay=0.1)
def test_rows_of_an_expired_batch_are_submitted_again_and_none_is_paid_twice(
    setup: Setup,
) -> None:
    result = setup.materialize(setup.asset())
    assert result.success
    provider = setup.provider()
    assert provider["creates"] == 2  # the expired batch, then its unrun half
    assert provider["expired"] == 1_000
    assert provider["processed"] == 2_000 == provider["submitted"] - provider["expired"]
    setup.stored_once()
    assert setup.stored().get_column("_error").null_count() == 2_000


@BOTH_APIS
@pytest.mark.provider(processing_delay=600, manual_clock=True)
def test_submit_and_end_then_the_sensor_requests_the_collecting_run(setup: Setup) -> None:
    routed = setup.asset(wait=False)
    first = setup.materialize(routed, raise_on_error=False)
    assert not first.success
    failure = next(e for e in first.all_events if e.is_step_failure)
    assert failure.step_failure_data is not None
    said = failure.step_failure_data.user_failure_data
    assert said is not None and said.description is not None
    assert said.description.startswith("Submitted, not materialized yet: 2,000 row(s) of 0-of-1")
    assert f"The sensor {ASSET}_provider_batches" in said.description
    metadata = {k: v.value for k, v in said.metadata.items()}
    (batch,) = json.loads(str(metadata["batches_pending"]))
    assert batch in said.description
    assert (
        metadata["rows_pending"] == 2_000
        and metadata["collected_by"] == f"{ASSET}_provider_batches"
    )
    # The provider's 24 h window from the submission (its record's time, this machine's clock).
    assert 0 < float(metadata["results_due_by"]) - time.time() <= 24 * 3600
    run = setup.instance.get_run_by_id(first.run_id)
    assert run is not None and run.tags[PENDING_TAG] == "2000"
    assert setup.provider()["creates"] == 1 and setup.provider()["submitted"] == 2_000

    retry = failed_partitions_sensor(routed, backoff_seconds=0)
    collect = provider_batches_sensor(routed)
    with dg.build_sensor_context(
        instance=setup.instance, resources={setup.api.key: setup.resource}
    ) as context:
        assert not retry(context).run_requests  # submitted, not failed: not the retry sensor's
        early = collect(context)
        assert not early.run_requests and "wait" in str(early.skip_reason)
        context.update_cursor(early.cursor)
        setup.clock.advance(601)  # the provider's batches end
        ready = collect(context)
        assert [r.partition_key for r in ready.run_requests] == [SHARD]
        context.update_cursor(ready.cursor)
        assert not collect(context).run_requests  # requested once

        second = setup.materialize(routed, tags=ready.run_requests[0].tags)
        assert second.success
        assert stats(second)["rows_computed"] == 2_000
        provider = setup.provider()
        assert provider["creates"] == 1  # collected, not submitted again
        assert provider["processed"] == 2_000 and provider["downloads"] == 1
        setup.stored_once()
        assert "No partition" in str(collect(context).skip_reason)


@BOTH_APIS
@pytest.mark.provider(processing_delay=4, manual_clock=True)
def test_a_cancelled_batch_gives_back_its_unrun_rows(setup: Setup) -> None:
    assert not setup.materialize(setup.asset(wait=False), raise_on_error=False).success
    setup.clock.advance(1)  # a quarter of the requests done
    (pending,) = setup.pending()
    setup.resource.batch_provider().cancel(pending)
    # The waiting run collects what ran and submits the rest, whose batch ends as the clock
    # ticks on meanwhile.
    with ticking(setup.clock):
        result = setup.materialize(setup.asset())
    assert result.success
    provider = setup.provider()
    assert provider["creates"] == 2 and provider["cancels"] == 1
    assert provider["cancelled"] == 1_500
    assert provider["processed"] == 2_000 == provider["submitted"] - provider["cancelled"]
    setup.stored_once()


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
    assert spec.kinds == {"polars", "parquet", setup.api.key, "batch"}
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
        source="tickets", id_column=ID, parse=OPENAI.parse, provider="claude", name=ASSET
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
