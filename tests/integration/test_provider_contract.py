"""The provider contract: every provider behind ``provider_batch_asset`` gives the same
guarantees, checked by one suite run against each provider's fake (``helpers/provider_cases.py``
``CASES``), through real Dagster materializations and the provider's real client over HTTP.

What each provider must hold, counted on the fake's side (batches created, requests processed
per ``custom_id``, online requests answered): a shard's rows submitted once and stored once, each
result on its own row (matched by the record id, whatever order the results come in); transient
per-request errors sent again within the run, invalid requests failed at once; the rows of an
expired or cancelled batch submitted again, none paid twice; a run that submits and ends, and the
run the sensor requests collecting what it left; one definition run online, as batches or both
(hybrid past its deadline: rows paid = rows stored); answers kept, so a changed parse asks
nothing again; results reused from the result store; the dry-run estimate at the provider's
batch price; credentials given by reference showing in no log. Kills are in
``tests/reliability/test_provider_kills.py``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg
import polars as pl
import pytest
from dagster._serdes import serialize_value
from helpers.jobs import ASSET, stats, step_error
from helpers.provider_cases import CASES, Fake, ProviderCase

from checkpoint_assets import (
    Budget,
    CheckpointIOManager,
    failed_partitions_sensor,
    provider_batch_asset,
    provider_batches_sensor,
    shard_partitions,
)
from checkpoint_assets.engine import Checkpoint, open_store
from checkpoint_assets.engine.providers.answers import ANSWER
from checkpoint_assets.engine.providers.submissions import BatchProvider
from checkpoint_assets.integration import metadata as md
from examples.llm_batch.jobs import ManualClock, Settings, expires

ID = "ticket_id"
SHARD = "0-of-1"
TEXTS = ("I was charged twice, please refund me", "The app crashes with an error", "hello")
ANSWERS = ("billing", "technical", "other")  # the fakes' rule for each of TEXTS
USAGE = ["input_tokens", "output_tokens"]

pytestmark = pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)


class Setup:
    """One provider's fake, a table of tickets, and materializations of a request/parse asset
    over one checkpoint."""

    def __init__(
        self, base_dir: str, case: ProviderCase, fake: Fake, rows: int, clock: ManualClock
    ) -> None:
        self.base_dir, self.case, self.fake, self.clock = base_dir, case, fake, clock
        self.df = pl.DataFrame({ID: list(range(rows)), "body": [TEXTS[i % 3] for i in range(rows)]})
        self.instance = dg.DagsterInstance.ephemeral()
        self.resource = case.resource(fake.urls)

    @contextmanager
    def adapter(self) -> Iterator[BatchProvider]:
        """The resource's batch adapter, outside Dagster (its credentials resolved)."""
        with self.resource.process_config_and_initialize_cm() as resource:
            yield self.case.adapter(resource)

    def asset(self, **kw: Any) -> dg.AssetsDefinition:
        case = self.case
        options: dict[str, Any] = {
            "name": ASSET,
            "source": "tickets",
            "id_column": ID,
            "parse": case.parse,
            "provider": case.key,
            "input_columns": ["body"],
            "partitions_def": shard_partitions(1),
            "usage_columns": USAGE,
            "poll_seconds": 0.05,
            "max_poll_seconds": 0.2,
            "max_concurrency": 8,
        }

        def routed(row: dict[str, Any]) -> dict[str, Any]:
            """The same request, whichever way it is sent."""
            return case.request(row["body"])

        return provider_batch_asset(**(options | kw))(routed)

    def resources(self) -> dict[str, Any]:
        return {
            "io_manager": CheckpointIOManager(base_dir=self.base_dir),
            "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
            self.case.key: self.resource,
        }

    def materialize(
        self,
        a: dg.AssetsDefinition,
        df: pl.DataFrame | None = None,
        tags: dict[str, str] | None = None,
        **config: Any,
    ) -> dg.ExecuteInProcessResult:
        table = self.df if df is None else df

        @dg.asset(name="tickets", io_manager_key="source_io")
        def tickets() -> pl.DataFrame:
            return table

        return dg.materialize(
            [tickets, a],
            instance=self.instance,
            resources=self.resources(),
            partition_key=SHARD,
            run_config={"ops": {a.key.path[-1]: {"config": config}}},
            tags=tags,
            raise_on_error=False,
        )

    def checkpoint(self, tag: str = "default", asset: str = ASSET) -> Checkpoint:
        return Checkpoint(open_store(self.base_dir), f"{asset}/{tag}/{SHARD}")

    def stored(self, tag: str = "default", asset: str = ASSET) -> pl.DataFrame:
        return self.checkpoint(tag, asset).load(ID).rows

    def stored_once(self, tag: str = "default") -> pl.DataFrame:
        """Every row stored in one row of one file (none twice); the rows stored."""
        files = self.checkpoint(tag).data_files()
        parts = pl.concat([pl.read_parquet(f).select(ID) for f in files])
        assert parts.height == parts.get_column(ID).n_unique() == self.df.height
        return self.stored(tag)

    def paid_once(self) -> None:
        """No request the fake processed in a batch was processed twice."""
        processed = self.fake.processed()
        assert processed and max(processed.values()) == 1

    def answered_by_row(self, stored: pl.DataFrame) -> None:
        """Each row holds the answer to its own text: results matched by the record id."""
        rows = stored.sort(ID)
        expected = [ANSWERS[i % 3] for i in rows.get_column(ID).to_list()]
        assert rows.get_column("answer").to_list() == expected


@pytest.fixture
def setup(
    tmp_path: Any, request: pytest.FixtureRequest, case: ProviderCase, monkeypatch: Any
) -> Iterator[Setup]:
    marker = request.node.get_closest_marker("provider")
    options = dict(marker.kwargs) if marker else {}
    rows = options.pop("rows", 300)
    manual = options.pop("manual_clock", False)  # the fake's time moves only when told
    if options.pop("first_batch_expires", False):
        options |= {"expire_rate": 0.5, "seed": _first_batch_expires(case.draws or case.name)}
    for variable, secret in case.secrets.items():
        monkeypatch.setenv(variable, secret)
    clock = ManualClock()
    with case.start(Settings(**options), clock if manual else time.time) as fake:
        yield Setup(str(tmp_path / "checkpoints"), case, fake, rows, clock)


def _first_batch_expires(api: str) -> int:
    """A seed under which the first batch a fake creates expires and the next ones do not (the
    fakes draw by their API's name and the batch's number, ``jobs.expires``)."""
    return next(
        seed
        for seed in range(1000)
        if [expires(Settings(expire_rate=0.5, seed=seed), api, n) for n in (1, 2, 3)]
        == [True, False, False]
    )


@contextmanager
def ticking(clock: ManualClock) -> Iterator[None]:
    """The fake's clock moving on by a second every 50 ms, for a run that waits."""
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


# Every create refused at first, a client's own retries too (they retry a 429 up to 5 times).
@pytest.mark.provider(refuse_creates=6, queue_retry_after=0.05)
def test_a_refusal_for_queue_room_is_no_failed_row_and_no_attempt_and_the_run_waits(
    setup: Setup,
) -> None:
    result = setup.materialize(setup.asset())
    assert result.success, step_error(result)  # the run waited for room, then submitted
    stored = setup.stored_once()
    assert stored.get_column("_error").null_count() == stored.height  # no failed row
    assert stored.get_column("_attempts").unique().to_list() == [1]  # a refusal is no attempt
    setup.answered_by_row(stored)
    setup.paid_once()
    assert setup.fake.counts()["processed"] == setup.df.height  # each row paid once
    meta = stats(result)
    assert meta["submissions_refused"] >= 1  # refused as QueueFull, not failed


@pytest.mark.provider(rows=2_000, processing_delay=0.2)
def test_a_shard_is_submitted_once_and_each_result_is_stored_on_its_own_row(
    setup: Setup,
) -> None:
    result = setup.materialize(setup.asset())
    assert result.success, step_error(result)
    counted = setup.fake.counts()
    assert counted["creates"] == 1
    assert counted["submitted"] == counted["processed"] == counted["succeeded"] == 2_000
    setup.paid_once()
    stored = setup.stored_once()
    setup.answered_by_row(stored)  # the fakes return results out of order
    meta = stats(result)
    assert meta["rows_computed"] == 2_000
    assert meta["usage/input_tokens"] == counted["input_tokens"]  # from the responses
    again = setup.materialize(setup.asset())
    assert again.success and setup.fake.counts()["creates"] == 1  # nothing left to submit


@pytest.mark.provider(error_rate=0.05, processing_delay=0.1)
def test_transient_request_errors_are_sent_again_within_the_run(setup: Setup) -> None:
    case = setup.case

    def invalid_for_two(row: dict[str, Any]) -> dict[str, Any]:
        return dict(case.invalid) if row[ID] < 2 else case.request(row["body"])

    # At 5 % errors, some row of 300 fails all eight requests in under 1e-8 of runs.
    asset = provider_batch_asset(
        name=ASSET,
        source="tickets",
        id_column=ID,
        parse=case.parse,
        provider=case.key,
        input_columns=["body"],
        partitions_def=shard_partitions(1),
        max_failed_fraction=0.05,
        max_attempts=8,
        poll_seconds=0.05,
        max_poll_seconds=0.2,
    )(invalid_for_two)
    result = setup.materialize(asset)
    assert result.success, step_error(result)  # one run: the failed requests went again
    counted = setup.fake.counts()
    sent_again = counted["submitted"] - 300
    assert counted["creates"] >= 2 and sent_again > 0
    assert counted["processed"] == counted["submitted"]  # every request sent ran once
    assert counted["errored"] == sent_again + 2  # ... and the two invalid requests, once each
    setup.paid_once()
    stored = setup.stored_once()
    failed = stored.filter(pl.col("_error").is_not_null())
    assert failed.get_column(ID).sort().to_list() == [0, 1]
    assert not failed.get_column("_error").str.starts_with(case.error).any()
    assert stored.get_column("_attempts").max() >= 2  # a row sent again counts each request


@pytest.mark.provider(first_batch_expires=True, expire_after=0.2, processing_delay=0.1)
def test_rows_of_an_expired_batch_are_submitted_again_and_none_is_paid_twice(
    setup: Setup,
) -> None:
    result = setup.materialize(setup.asset())
    assert result.success, step_error(result)
    counted = setup.fake.counts()
    assert counted["creates"] == 2  # the expired batch, then its unrun half
    assert counted["expired"] == 150
    assert counted["processed"] == 300 == counted["submitted"] - counted["expired"]
    setup.paid_once()
    setup.answered_by_row(setup.stored_once())


@pytest.mark.provider(processing_delay=600, manual_clock=True)
def test_a_run_that_submits_and_ends_is_collected_by_the_run_the_sensor_requests(
    setup: Setup,
) -> None:
    routed = setup.asset(wait=False)
    first = setup.materialize(routed)
    assert not first.success
    failure = next(e for e in first.all_events if e.is_step_failure)
    said = failure.step_failure_data.user_failure_data  # type: ignore[union-attr]
    assert said is not None and said.description is not None
    assert said.description.startswith("Submitted, not materialized yet: 300 row(s) of 0-of-1")
    assert setup.fake.counts()["creates"] == 1 and setup.fake.counts()["submitted"] == 300

    retry = failed_partitions_sensor(routed, backoff_seconds=0)
    collect = provider_batches_sensor(routed)
    with dg.build_sensor_context(
        instance=setup.instance, resources={setup.case.key: setup.resource}
    ) as context:
        assert not retry(context).run_requests  # submitted, not failed: not the retry sensor's
        early = collect(context)
        assert not early.run_requests and "wait" in str(early.skip_reason)
        context.update_cursor(early.cursor)
        setup.clock.advance(601)  # the fake's batch ends
        ready = collect(context)
        assert [r.partition_key for r in ready.run_requests] == [SHARD]
        context.update_cursor(ready.cursor)
        second = setup.materialize(routed, tags=ready.run_requests[0].tags)
    assert second.success, step_error(second)
    assert stats(second)["rows_computed"] == 300
    counted = setup.fake.counts()
    assert counted["creates"] == 1 and counted["processed"] == 300  # collected, not sent again
    setup.paid_once()
    setup.answered_by_row(setup.stored_once())


@pytest.mark.provider(processing_delay=4, manual_clock=True)
def test_a_cancelled_batch_gives_back_its_unrun_rows(setup: Setup) -> None:
    assert not setup.materialize(setup.asset(wait=False)).success
    setup.clock.advance(1)  # a quarter of the requests done
    pending = setup.instance.fetch_observations(dg.AssetKey(ASSET), limit=1).records[0]
    assert pending.asset_observation is not None
    (batch,) = json.loads(str(pending.asset_observation.metadata["batches_pending"].value))
    with setup.adapter() as api:
        api.cancel(batch)
    with ticking(setup.clock):  # the next batch ends as the clock ticks on
        result = setup.materialize(setup.asset())
    assert result.success, step_error(result)
    counted = setup.fake.counts()
    assert counted["creates"] == 2 and counted["cancels"] == 1 and counted["cancelled"] == 225
    assert counted["processed"] == 300 == counted["submitted"] - counted["cancelled"]
    setup.paid_once()
    setup.stored_once()


@pytest.mark.provider(rows=120)
def test_one_definition_gives_the_same_outputs_online_and_as_batches(setup: Setup) -> None:
    asset = setup.asset()  # the asset's default mode: batch
    batched = setup.materialize(asset, checkpoint_tag="batched")
    online = setup.materialize(asset, checkpoint_tag="online", mode="online")
    assert batched.success and online.success, step_error(online)
    assert setup.fake.counts()["processed"] == 120 and setup.fake.online() == 120
    columns = [ID, "answer", *USAGE, "_error"]
    by_batch = setup.stored("batched").sort(ID).select(columns)
    by_request = setup.stored("online").sort(ID).select(columns)
    assert by_request.equals(by_batch)
    setup.answered_by_row(by_request)
    assert (stats(online)["mode"], stats(online)["rows_online"]) == ("online", 120)


@pytest.mark.provider(rows=400, processing_delay=6.0)
def test_a_hybrid_run_past_its_deadline_pays_each_row_once(setup: Setup) -> None:
    # The batch would take 6 s; at 0.5 s it is cancelled and its rows without a result go online.
    result = setup.materialize(setup.asset(), mode="hybrid", deadline="0.5s")
    assert result.success, step_error(result)
    counted = setup.fake.counts()
    assert counted["cancels"] == 1 and counted["processed"] > 0 and counted["cancelled"] > 0
    assert counted["processed"] + counted["cancelled"] == 400
    stored = setup.stored_once()
    assert setup.fake.paid() == stored.height == 400  # rows paid = rows stored
    setup.paid_once()
    assert stats(result)["rows_online"] == setup.fake.online() == counted["cancelled"]


@pytest.mark.provider(rows=60)
def test_answers_are_kept_so_a_changed_parse_asks_nothing_again(setup: Setup) -> None:
    assert setup.materialize(setup.asset()).success
    parse = setup.case.parse

    def shouted(body: dict[str, Any]) -> dict[str, Any]:
        out = parse(body)
        return {**out, "answer": out["answer"].upper()}

    changed = setup.materialize(setup.asset(parse=shouted))
    assert changed.success, step_error(changed)
    assert setup.fake.counts()["submitted"] == 60 and setup.fake.online() == 0  # nothing asked
    stored = setup.stored().sort(ID)
    assert stored.get_column("answer").head(3).to_list() == ["BILLING", "TECHNICAL", "OTHER"]
    assert stored.get_column(ANSWER).null_count() == 0


@pytest.mark.provider(rows=40)
def test_rows_the_result_store_holds_are_not_submitted_again(setup: Setup) -> None:
    first = setup.materialize(setup.asset(reuse=True))
    assert first.success, step_error(first)
    # Another asset over 20 of those tickets and 20 new ones.
    other = setup.df.with_columns(pl.col(ID) + 20, body=pl.col("body").shift(-20)).fill_null(
        "a new ticket"
    )
    second = setup.materialize(setup.asset(name="second", reuse=True), df=other)
    assert second.success, step_error(second)
    assert setup.fake.counts()["submitted"] == 40 + 20
    (event,) = second.asset_materializations_for_node("second")
    assert event.metadata["rows_from_store"].value == 20
    assert setup.stored(asset="second").get_column(ANSWER).null_count() == 0


@pytest.mark.provider(rows=120)
def test_the_dry_run_estimates_the_cost_at_the_providers_batch_price(setup: Setup) -> None:
    price = setup.case.price
    budget = Budget({"model": price}, input_tokens="input_tokens", output_tokens="output_tokens")
    asset = setup.asset(budget=budget)
    dry = setup.materialize(asset, dry_run=True)
    assert dry.success, step_error(dry)
    assert setup.fake.counts()["creates"] == 0 and setup.fake.online() == 0  # nothing sent
    (event,) = dry.get_asset_observation_events()
    observation = event.asset_observation_data.asset_observation
    found = md.estimate_of({k: md.plain(v) for k, v in observation.metadata.items()})
    assert found.rows_to_compute == 120 and found.input_tokens > 0
    assert found.cost_online_usd is not None and found.cost_batch_usd is not None
    assert found.cost_batch_usd == pytest.approx(found.cost_online_usd * (1 - price.batch_discount))
    done = setup.materialize(asset)
    assert done.success, step_error(done)
    counted = setup.fake.counts()
    paid = (counted["input_tokens"] * price.input + counted["output_tokens"] * price.output) / 1e6
    cost = stats(done)[md.COST_USD]
    assert cost == pytest.approx(paid * (1 - price.batch_discount))
    assert cost <= found.cost_batch_usd  # the estimate is a ceiling (max_tokens a row)


@pytest.mark.provider(rows=60, error_rate=0.1)
def test_credentials_given_by_reference_show_in_no_log(setup: Setup) -> None:
    assert setup.case.secrets, "a case names the secrets its resource reads"
    assert setup.materialize(setup.asset(), mode="hybrid").success
    assert setup.fake.counts()["errored"] > 0 and setup.fake.online() > 0
    texts = []
    for record in setup.instance.get_run_records():
        texts.append(serialize_value(record.dagster_run))
        texts.extend(serialize_value(e) for e in setup.instance.all_logs(record.dagster_run.run_id))
    for secret in setup.case.secrets.values():
        assert not [t for t in texts if secret in t]
