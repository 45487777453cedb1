"""Provider batches through Anthropic's Message Batches: real Dagster materializations, the real
``anthropic`` client over HTTP against the local provider (``examples/llm_batch/provider.py``),
which counts every call and every request it processed.

A shard's rows are submitted once and stored once, per-request errors are failed rows retried on
the next run, expired and cancelled batches give back their unrun rows and nothing is paid twice,
the submit-and-end path leaves the collecting to the sensor, and a batch created by a run that
stopped before recording it is found again by its requests' ``custom_id`` prefix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import dagster as dg
import polars as pl
import pytest
from helpers.jobs import ASSET, stats

from checkpoint_assets import (
    AnthropicResource,
    CheckpointIOManager,
    failed_partitions_sensor,
    provider_batch_asset,
    provider_batches_sensor,
    shard_partitions,
)
from checkpoint_assets.engine import Checkpoint, open_store
from checkpoint_assets.engine.submissions import Request, custom_id
from checkpoint_assets.integration.pending import PENDING_TAG
from checkpoint_assets.resources.anthropic_batches import (
    AnthropicBatches,
    SubmissionUndecidedError,
)
from examples.llm_batch.jobs import expires
from examples.llm_batch.provider import ManualClock, Settings, serve
from examples.llm_batch.provider import stats as served

ID = "ticket_id"
SHARD = "0-of-1"
TEXTS = ("I was charged twice, please refund me", "The app crashes with an error", "hello")
ANSWERS = ("billing", "technical", "other")


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


def parse(message: dict[str, Any]) -> dict[str, Any]:
    return {
        "answer": message["content"][0]["text"],
        "input_tokens": message["usage"]["input_tokens"],
    }


def asset(**kw: Any) -> dg.AssetsDefinition:
    options: dict[str, Any] = {
        "source": "tickets",
        "id_column": ID,
        "parse": parse,
        "provider": "claude",
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


class Setup:
    def __init__(self, base_dir: str, url: str, rows: int, clock: ManualClock) -> None:
        self.base_dir, self.url, self.clock = base_dir, url, clock
        self.df = pl.DataFrame({ID: list(range(rows)), "body": [TEXTS[i % 3] for i in range(rows)]})
        self.instance = dg.DagsterInstance.ephemeral()
        self.claude = AnthropicResource(
            base_url=url.removesuffix("/v1"), api_key="local", model="claude-test", max_tokens=8
        )

    def resources(self) -> dict[str, Any]:
        return {
            "io_manager": CheckpointIOManager(base_dir=self.base_dir),
            "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
            "claude": self.claude,
        }

    def source(self) -> dg.AssetsDefinition:
        @dg.asset(name="tickets", io_manager_key="source_io")
        def tickets_asset() -> pl.DataFrame:
            return self.df

        return tickets_asset

    def materialize(self, a: dg.AssetsDefinition, **kw: Any) -> dg.ExecuteInProcessResult:
        return dg.materialize(
            [self.source(), a],
            instance=self.instance,
            resources=self.resources(),
            partition_key=SHARD,
            **kw,
        )

    def provider(self) -> dict[str, int]:
        return served(self.url)

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(open_store(self.base_dir), f"{ASSET}/default/{SHARD}")

    def stored(self) -> pl.DataFrame:
        return self.checkpoint().load(ID).rows

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
    manual = options.pop("manual_clock", False)  # batches move only when the test says
    clock = ManualClock()
    with serve(Settings(**options), clock=clock if manual else time.time) as url:
        yield Setup(str(tmp_path / "checkpoints"), url, rows, clock)


@pytest.mark.provider(rows=20_000, processing_delay=0.3)
def test_a_shard_of_20000_rows_is_one_message_batch_stored_once(setup: Setup) -> None:
    result = setup.materialize(asset())
    assert result.success
    provider = setup.provider()
    assert provider["creates"] == 1
    assert provider["submitted"] == provider["processed"] == provider["succeeded"] == 20_000
    setup.stored_once()
    stored = setup.stored().sort(ID)
    assert stored.get_column("answer").to_list()[:3] == list(ANSWERS)
    meta = stats(result)
    assert meta["rows_computed"] == 20_000
    assert meta["usage/input_tokens"] == sum(len(TEXTS[i % 3].split()) for i in range(20_000))
    again = setup.materialize(asset())
    assert again.success and setup.provider()["submitted"] == 20_000  # nothing left to do
    assert setup.provider()["creates"] == 1


@pytest.mark.provider(error_rate=0.05, processing_delay=0.1)
def test_per_request_errors_are_failed_rows_retried_on_the_next_run(setup: Setup) -> None:
    first = setup.materialize(asset(max_failed_fraction=0.2))
    failed = stats(first)["rows_failed"]
    assert 40 < failed < 180  # about 5 % of 2,000
    errors = setup.stored().filter(pl.col("_error").is_not_null())
    assert errors.get_column("_error").str.starts_with("api_error: ").all()
    second = setup.materialize(asset(max_failed_fraction=0.2))
    assert stats(second)["rows_computed"] == failed  # only the failed rows are submitted again
    assert setup.provider()["submitted"] == setup.provider()["processed"] == 2_000 + failed
    assert stats(second)["rows_failed"] < failed


def _first_batch_expires() -> int:
    """A seed under which the first message batch expires and the next ones do not."""
    return next(
        seed
        for seed in range(1000)
        if [expires(Settings(expire_rate=0.5, seed=seed), "anthropic", n) for n in (1, 2, 3)]
        == [True, False, False]
    )


@pytest.mark.provider(
    expire_rate=0.5, seed=_first_batch_expires(), expire_after=0.2, processing_delay=0.1
)
def test_rows_of_an_expired_batch_are_submitted_again_and_none_is_paid_twice(
    setup: Setup,
) -> None:
    result = setup.materialize(asset())
    assert result.success
    provider = setup.provider()
    assert provider["creates"] == 2  # the expired batch, then its unrun half
    assert provider["expired"] == 1_000
    assert provider["processed"] == 2_000 == provider["submitted"] - provider["expired"]
    setup.stored_once()
    assert setup.stored().get_column("_error").null_count() == 2_000


@pytest.mark.provider(processing_delay=2, manual_clock=True)
def test_submit_and_end_then_the_sensor_requests_the_collecting_run(setup: Setup) -> None:
    routed = asset(wait=False)
    first = setup.materialize(routed, raise_on_error=False)
    assert not first.success
    failure = next(e for e in first.all_events if e.is_step_failure)
    assert failure.step_failure_data is not None
    assert "Submitted, not materialized yet" in str(failure.step_failure_data.error)
    run = setup.instance.get_run_by_id(first.run_id)
    assert run is not None and run.tags[PENDING_TAG] == "2000"
    assert setup.provider()["creates"] == 1 and setup.provider()["submitted"] == 2_000

    retry = failed_partitions_sensor(routed, backoff_seconds=0)
    collect = provider_batches_sensor(routed, provider="claude")
    with dg.build_sensor_context(
        instance=setup.instance, resources={"claude": setup.claude}
    ) as context:
        assert not retry(context).run_requests  # submitted, not failed: not the retry sensor's
        early = collect(context)
        assert not early.run_requests and "wait" in str(early.skip_reason)
        context.update_cursor(early.cursor)
        setup.clock.advance(2.1)
        ready = collect(context)
        assert [r.partition_key for r in ready.run_requests] == [SHARD]
        context.update_cursor(ready.cursor)
        second = setup.materialize(routed, tags=ready.run_requests[0].tags)
        assert second.success
        assert stats(second)["rows_computed"] == 2_000
    provider = setup.provider()
    assert provider["creates"] == 1  # collected, not submitted again
    assert provider["processed"] == 2_000 and provider["downloads"] == 1
    setup.stored_once()


@pytest.mark.provider(processing_delay=4, manual_clock=True)
def test_a_cancelled_batch_gives_back_its_unrun_rows(setup: Setup) -> None:
    assert not setup.materialize(asset(wait=False), raise_on_error=False).success
    setup.clock.advance(1)  # a quarter of the requests done
    claude = anthropic.Anthropic(base_url=setup.url.removesuffix("/v1"), api_key="local")
    (batch,) = claude.messages.batches.list().data
    claude.messages.batches.cancel(batch.id)
    # The waiting run collects what ran and submits the rest, whose batch ends as the clock
    # ticks on meanwhile.
    done = threading.Event()
    ticking = threading.Thread(target=tick, args=(setup.clock, done), daemon=True)
    ticking.start()
    try:
        result = setup.materialize(asset())
    finally:
        done.set()
        ticking.join()
    assert result.success
    provider = setup.provider()
    assert provider["creates"] == 2 and provider["cancels"] == 1
    assert provider["cancelled"] == 1_500
    assert provider["processed"] == 2_000 == provider["submitted"] - provider["cancelled"]
    setup.stored_once()


def tick(clock: ManualClock, done: threading.Event) -> None:
    while not done.wait(0.05):
        clock.advance(1.0)


# -- finding a batch again -------------------------------------------------------------------------
def _requests(tag: str, n: int) -> list[Request]:
    body = {"messages": [{"role": "user", "content": "hello"}]}
    return [Request(custom_id(tag, i), body) for i in range(n)]


def test_a_batch_created_but_never_recorded_is_found_by_its_custom_id_prefix() -> None:
    with serve(Settings(processing_delay=0.4)) as url:
        client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="local")
        api = AnthropicBatches(client, {"model": "m", "max_tokens": 8}, find_poll_seconds=0.1)
        since = time.time() - 1
        other = api.create(_requests("ca" + "1" * 32, 3), None, "ca" + "1" * 32)
        mine = api.create(_requests("ca" + "2" * 32, 5), None, "ca" + "2" * 32)
        newer = api.create(_requests("ca" + "3" * 32, 5), None, "ca" + "3" * 32)
        # Still processing, so nothing tells them apart yet: find waits for them to end.
        assert api.find("ca" + "2" * 32, since) == mine
        assert api.find("ca" + "1" * 32, since) == other
        assert api.find("ca" + "3" * 32, since) == newer
        assert api.find("ca" + "4" * 32, since) is None, "never created: none of them holds it"
        assert api.find("ca" + "1" * 32, time.time() + 60) is None, "created before the intent"
        assert served(url)["creates"] == 3


def test_find_stops_without_sending_anything_while_it_cannot_tell() -> None:
    with serve(Settings(processing_delay=60)) as url:
        client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="local")
        api = AnthropicBatches(client, {"model": "m", "max_tokens": 8}, find_wait_seconds=0.3)
        api.find_poll_seconds = 0.1
        since = time.time() - 1
        running = api.create(_requests("ca" + "1" * 32, 3), None, "ca" + "1" * 32)
        with pytest.raises(SubmissionUndecidedError, match=running) as undecided:
            api.find("ca" + "2" * 32, since)
        assert "Nothing was submitted again" in str(undecided.value)
        assert served(url)["creates"] == 1
