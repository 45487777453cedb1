"""Provider batches against a provider whose queue is smaller than a shard's rows: real Dagster
materializations, the local batch provider over HTTP (``examples/llm_batch/provider.py``, with
OpenAI's enqueued token limit and Anthropic's queued requests limit), the real clients.

A submission refused for want of room in the queue is no failure: it leaves no failed row, is no
attempt, and the run that waits submits its rows again once there is room. Shards in different
processes share the queue through the checkpoint store, so together they stay within it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from helpers.provider_cases import anthropic_parse, openai_parse
from test_provider_batches import SHARD, TEXTS
from test_provider_batches import Setup as OpenAISetup

from checkpoint_assets import AnthropicResource, OpenAIResource
from checkpoint_assets.engine import open_store
from checkpoint_assets.engine.checkpoints.layout import QUEUES
from checkpoint_assets.engine.providers.submission_records import Records, Submission
from checkpoint_assets.engine.rows import ATTEMPTS
from examples.llm_batch.jobs import ManualClock, Settings
from examples.llm_batch.provider import serve, stats

ID = "ticket_id"
# Rows of the three texts of ``test_provider_batches.tickets``: their input tokens as the
# provider counts them (bytes over 4), 2 to 10 a row.
ROWS = 2_000
TOKENS = sum(-(-len(TEXTS[i % 3].encode()) // 4) for i in range(ROWS))


@dataclass(frozen=True)
class Api:
    """One of the two batch APIs the local provider speaks: its resource key, the resource on
    the provider's base URL, and how an answer is read."""

    name: str
    key: str
    resource: Callable[[str], OpenAIResource | AnthropicResource]
    parse: Callable[[dict[str, Any]], dict[str, Any]]


OPENAI = Api(
    "openai",
    "openai",
    lambda url: OpenAIResource(base_url=url, api_key="local", model="m"),
    openai_parse,
)
ANTHROPIC = Api(
    "anthropic",
    "claude",
    lambda url: AnthropicResource(
        base_url=url.removesuffix("/v1"), api_key="local", model="claude-test", max_tokens=8
    ),
    anthropic_parse,
)


class Setup(OpenAISetup):
    """``test_provider_batches``' setup through either API."""

    def __init__(self, base_dir: str, url: str, rows: int, clock: ManualClock, api: Api) -> None:
        super().__init__(base_dir, url, rows, clock)
        self.api = api
        self.resource = api.resource(url)

    def asset(self, **kw: Any) -> dg.AssetsDefinition:
        return super().asset(**({"parse": self.api.parse, "provider": self.api.key} | kw))

    def resources(self) -> dict[str, Any]:
        resources = super().resources()
        del resources["openai"]
        return {**resources, self.api.key: self.resource}


def records(setup: Setup, partition: str = SHARD) -> list[Submission]:
    checkpoint = setup.checkpoint(partition)
    return Records(checkpoint.store, checkpoint.files).load()


def no_failed_rows_and_no_attempt_spent(setup: Setup, partition: str = SHARD) -> None:
    stored = setup.stored(partition)
    assert stored.height == ROWS
    assert stored.get_column("_error").null_count() == ROWS  # no failed row
    assert stored.get_column(ATTEMPTS).unique().to_list() == [1]  # one request each, paid once


@pytest.fixture
def queued(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Setup]:
    api: Api = request.param
    limits = {"openai_enqueued_tokens": 6_000, "anthropic_queued_requests": 700}
    settings = Settings(processing_delay=0.4, queue_retry_after=0.05, **limits)
    with serve(settings) as url:
        yield Setup(str(tmp_path / "checkpoints"), url, ROWS, ManualClock(), api)


@pytest.mark.parametrize("queued", [OPENAI, ANTHROPIC], ids=["openai", "anthropic"], indirect=True)
def test_a_queue_refusal_is_no_failed_row_and_no_attempt(queued: Setup) -> None:
    setup = queued
    # The queue holds about a third of the shard. Nothing tells the run its size: the first
    # submission (the whole shard) is refused, and the refusal states the limit.
    result = setup.materialize(setup.asset())
    assert result.success  # a run that waits never fails for want of room
    no_failed_rows_and_no_attempt_spent(setup)
    setup.stored_once()
    provider = setup.provider()
    assert provider["submitted"] == provider["processed"] == ROWS  # none paid twice
    done = records(setup)
    refused = [s for s in done if s.stage == "refused"]
    assert len(refused) == 1 and len(refused[0].ids) == ROWS  # the first, whole-shard one
    assert "limit" in refused[0].note.lower()
    assert all(s.attempt == 1 for s in done)  # a refusal is no attempt
    collected = [s for s in done if s.stage == "collected"]
    assert len(collected) >= 3 and sum(len(s.ids) for s in collected) == ROWS
    if setup.api is OPENAI:
        assert provider["queue_refused"] == 1
        assert provider["enqueued_peak"] <= 6_000
        assert all(s.tokens <= 6_000 for s in collected)
    else:  # the client's own retries of the 429 are refused too, then the run waits
        assert provider["queue_refused"] >= 1
        assert provider["queued_peak"] <= 700
        assert all(len(s.ids) <= 700 for s in collected)
    # The limit the refusal stated is written down for every shard of the queue.
    store = open_store(setup.base_dir)
    (limits,) = [
        json.loads(store.get(f.path))
        for f in store.list_recursive(store.path(QUEUES))
        if f.name == "limits.json"
    ]
    assert limits == (
        {"enqueued_tokens": 6_000} if setup.api is OPENAI else {"queued_requests": 700}
    )
    # Every claim of the queue is released once its batch is collected.
    assert [f.name for f in store.list_recursive(store.path(QUEUES))] == ["limits.json"]


CHILD = Path(__file__).parent.parent / "helpers" / "queue_child.py"


def test_two_shards_in_two_processes_share_the_queue_and_stay_within_it(tmp_path: Path) -> None:
    # Each shard's rows take about 80% of the queue: submitted at once, one would be refused
    # unless the shards know of each other's submissions.
    tokens_per_shard = TOKENS // 2
    limit = int(tokens_per_shard / 0.8)
    settings = Settings(processing_delay=1.0, openai_enqueued_tokens=limit)
    base_dir = str(tmp_path / "checkpoints")
    with serve(settings) as url:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        children = [
            subprocess.Popen(
                [sys.executable, str(CHILD), url, base_dir, str(ROWS), shard, str(limit)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for shard in ("0-of-2", "1-of-2")
        ]
        outs = []
        started = time.monotonic()
        for child in children:
            out, err = child.communicate(timeout=300)
            assert child.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
        provider = stats(url)
    assert all(o["success"] for o in outs), outs
    assert provider["queue_refused"] == 0  # the queue was never asked for more than it holds
    assert provider["enqueued_peak"] <= limit
    assert provider["submitted"] == provider["processed"] == ROWS
    assert sum(o["rows"] for o in outs) == ROWS
    assert sum(o["failed"] for o in outs) == 0
    # One shard's batch waited for the other's to end.
    assert time.monotonic() - started < 300


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_spent_quota_online_stops_the_run_naming_it_and_keeps_what_is_done(
    tmp_path: Path, api: str
) -> None:
    from helpers.jobs import step_error
    from test_modes import Setup as ModesSetup

    from examples.llm_batch.online import serve as serve_both
    from examples.llm_openai.server import Settings as ChatSettings

    with serve_both(Settings(), ChatSettings(quota_requests=300)) as (url, servers):
        setup = ModesSetup(str(tmp_path / "checkpoints"), url, servers, 1_000, api)
        result = setup.materialize(setup.asset(), mode="online")
        assert not result.success
        error = step_error(result)
        assert error.startswith("QuotaExhaustedError")
        said = "insufficient_quota" if api == "openai" else "spend limit"
        assert said in error and "Waiting does not help" in error
        chat = servers.chat.snapshot()
        # It stopped at the first refusal of each call in flight: no retries, no pauses.
        assert chat["quota_spent"] <= 8  # max_concurrency
        stored = setup.stored()
        assert stored.height == chat["ok"] == 300  # what was done is kept
        assert stored.get_column("_error").null_count() == stored.height  # no failed row


def test_submit_and_end_leaves_rows_waiting_for_room_and_the_sensor_asks_for_the_rest(
    tmp_path: Path,
) -> None:
    import dagster as dg
    from click.testing import CliRunner

    from checkpoint_assets import OpenAIResource, failed_partitions_sensor, provider_batches_sensor
    from checkpoint_assets.cli import cli
    from checkpoint_assets.integration.watch.pending import PENDING_TAG

    limit = int(TOKENS * 0.4)  # the queue holds 40% of the shard
    clock = ManualClock()
    settings = Settings(processing_delay=600, openai_enqueued_tokens=limit)
    with serve(settings, clock=clock) as url:
        setup = Setup(str(tmp_path / "checkpoints"), url, ROWS, clock, OPENAI)
        setup.resource = OpenAIResource(
            base_url=url, api_key="local", model="m", enqueued_tokens=limit
        )
        routed = setup.asset(wait=False)
        collect = provider_batches_sensor(routed)
        retry = failed_partitions_sensor(routed, backoff_seconds=0)
        runs, waiting_seen = 0, []
        with (
            dg.build_sensor_context(
                instance=setup.instance, resources={"openai": setup.resource}
            ) as context,
            dg.build_sensor_context(instance=setup.instance) as retry_context,
        ):
            while True:
                runs += 1
                result = setup.materialize(routed, raise_on_error=False)
                if result.success:
                    break
                failure = next(e for e in result.all_events if e.is_step_failure)
                assert failure.step_failure_data is not None
                said = failure.step_failure_data.user_failure_data
                assert said is not None and said.description is not None
                meta = {k: v.value for k, v in said.metadata.items()}
                waiting_seen.append(meta["rows_waiting_for_queue"])
                if meta["rows_waiting_for_queue"]:
                    assert "wait for room in the provider's queue" in said.description
                    shown = CliRunner().invoke(cli, ["status", setup.base_dir, "--json"])
                    (row,) = json.loads(shown.output)
                    assert row["rows_waiting_for_queue"] == meta["rows_waiting_for_queue"]
                run = setup.instance.get_run_by_id(result.run_id)
                assert run is not None and PENDING_TAG in run.tags
                assert not retry(retry_context).run_requests  # no retry of a run that waits
                early = collect(context)
                assert not early.run_requests  # its batches still run
                context.update_cursor(early.cursor)
                clock.advance(601)  # they end: room frees
                ready = collect(context)
                assert [r.partition_key for r in ready.run_requests] == [SHARD]
                context.update_cursor(ready.cursor)
                assert runs < 8
        provider = setup.provider()
    # Each run submitted what the queue had room for; none was refused or failed a row.
    assert waiting_seen[0] > 0 and runs >= 3
    assert provider["queue_refused"] == 0 and provider["enqueued_peak"] <= limit
    assert provider["submitted"] == provider["processed"] == ROWS
    no_failed_rows_and_no_attempt_spent(setup)
    setup.stored_once()


def test_each_partition_whose_batches_ended_frees_room_for_one_waiting_partition() -> None:
    """A batch that ends frees about one submission's room: the sensor requests the partition
    that collects it and one partition whose rows wait for room (the longest waiting), not every
    waiting partition, so a backfill far larger than the queue is not a run per partition at
    each batch's end."""
    import time
    import types

    import dagster as dg

    from checkpoint_assets.engine.providers.submissions import State
    from checkpoint_assets.integration.watch.provider_sensor import Pending, PendingState, _ready

    ended = {"b-ended"}
    api = types.SimpleNamespace(
        poll=lambda b: types.SimpleNamespace(state=State.ENDED if b in ended else State.RUNNING)
    )
    now = time.time()
    state = PendingState(
        pending={
            "0": Pending("r0", ["b-ended"], 1, at=now - 60),
            "1": Pending("r1", ["b-running"], 2, at=now - 60),
            "2": Pending("r2", [], 3, waiting=40, at=now - 30),
            "3": Pending("r3", [], 4, waiting=40, at=now - 40),  # has waited longest
            "4": Pending("r4", [], 5, waiting=40, at=now - 20),
        }
    )
    key = dg.AssetKey("routed")
    with dg.instance_for_test() as instance:
        assert _ready(instance, key, None, api, state) == ["0", "3"]  # type: ignore[arg-type]
        ended.add("b-running")
        state.pending["1"].requested = False
        assert _ready(instance, key, None, api, state) == ["1", "2"]  # type: ignore[arg-type]
        # "4" waits: no batch ended since, and the queue was seen full less than 600 s ago.
        assert _ready(instance, key, None, api, state) == []  # type: ignore[arg-type]
