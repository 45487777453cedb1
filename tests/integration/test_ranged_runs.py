"""Ranged runs (several shards in one run, as a backfill with a ``backfill_policy`` launches them):
each shard is its own outcome in the instance.

Each shard calls its own HTTP endpoint on 127.0.0.1; one endpoint is down (a port with nothing
listening). Runs are real ``dg.materialize`` runs against a real instance.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import Job, Storage, build_job, ids_in_shard, tickets

from checkpoint_assets import checkpoint_checks, failed_partitions_sensor, shard_partitions
from checkpoint_assets.integration.watch.sensor import RETRY_OF_TAG

SHARDS = shard_partitions(4)
KEYS = SHARDS.get_partition_keys()
RANGE = {
    "dagster/asset_partition_range_start": KEYS[0],
    "dagster/asset_partition_range_end": KEYS[-1],
}
ROWS = 80
pytestmark = pytest.mark.parametrize("storage", ["local"], indirect=True)


class _Route(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answer = json.dumps([text.upper() for text in body]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A live endpoint: answers a JSON list of texts with the same texts in upper case."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Route)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def dead_endpoint() -> str:
    """A URL on 127.0.0.1 where nothing listens: every request is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def endpoint_job(
    storage: Storage, instance: dg.DagsterInstance, endpoints: dict[int, str], **kw: Any
) -> Job:
    """A job of ``SHARDS`` whose rows of shard ``i`` are routed by ``endpoints[i]``."""
    df = tickets(ROWS)
    shard_of = {i: s for s in range(4) for i in ids_in_shard(df, s, 4)}

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        ids = batch.get_column("ticket_id").to_list()
        request = urllib.request.Request(
            endpoints[shard_of[ids[0]]],
            data=json.dumps(batch.get_column("body").to_list()).encode(),
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            routes = json.loads(answer.read())
        return pl.DataFrame({"ticket_id": ids, "route": routes})

    return build_job(
        storage,
        df,
        fn=fn,
        partitions_def=SHARDS,
        instance=instance,
        backfill_policy=dg.BackfillPolicy.single_run(),
        min_flush_seconds=0,
        **kw,
    )


def ranged(job: Job, **config: Any) -> dg.ExecuteInProcessResult:
    """A run of every shard, as a single-run backfill launches it."""
    return dg.materialize(
        [job.source, job.asset],
        instance=job.instance,
        resources=job.resources(),
        tags=RANGE,
        run_config={"ops": {"routed": {"config": config}}} if config else None,
        raise_on_error=False,
    )


def failure(result: dg.ExecuteInProcessResult) -> tuple[str, dict[str, Any]]:
    """The run's step failure: its message and its metadata."""
    events = result.get_step_failure_events()
    assert events, "the run did not fail"
    data = events[0].step_failure_data
    assert data.error is not None
    metadata = data.user_failure_data.metadata if data.user_failure_data else {}
    return data.error.message, dict(metadata)


def outcomes(metadata: dict[str, Any]) -> dict[str, str]:
    return {r.data["shard"]: r.data["outcome"] for r in metadata["shards"].records}


def materialized(job: Job) -> list[str]:
    return sorted(job.instance.get_materialized_partitions(job.asset.key))


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as instance:
        yield instance


def test_a_ranged_run_materializes_each_finished_shard_and_names_the_one_that_failed(
    storage: Storage, instance: dg.DagsterInstance, endpoint: str
) -> None:
    endpoints = {0: endpoint, 1: endpoint, 2: dead_endpoint(), 3: endpoint}
    job = endpoint_job(storage, instance, endpoints)

    first = ranged(job)

    assert not first.success
    # The shards after the broken one ran too; each finished shard is materialized.
    assert materialized(job) == [KEYS[0], KEYS[1], KEYS[3]]
    statuses = instance.get_status_by_partition(job.asset.key, KEYS, SHARDS)
    assert statuses[KEYS[2]] == dg.AssetPartitionStatus.FAILED
    message, metadata = failure(first)
    assert f"Failure: 1 of 4 shards of routed failed: {KEYS[2]}.\n" in message
    assert f"- {KEYS[2]}: OutageError:" in message and "Connection refused" in message
    assert f"3 materialized: {KEYS[0]}, {KEYS[1]}, {KEYS[3]}." in message
    assert outcomes(metadata) == {
        KEYS[0]: "materialized",
        KEYS[1]: "materialized",
        KEYS[2]: "failed",
        KEYS[3]: "materialized",
    }
    # Each shard's materialization carries its own figures.
    for key in (KEYS[0], KEYS[1], KEYS[3]):
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=job.asset.key, asset_partitions=[key]), limit=5
        ).records
        assert len(records) == 1  # recorded once
        shard_rows = len(ids_in_shard(tickets(ROWS), KEYS.index(key), 4))
        event = records[0].asset_materialization
        assert event is not None and event.metadata["rows_computed"].value == shard_rows

    endpoints[2] = endpoint  # the endpoint is back
    job.calls.clear()
    retry = ranged(job)

    assert retry.success
    assert materialized(job) == KEYS
    # The retry of the range computes only the failed shard's rows.
    assert sorted(job.computed_ids()) == sorted(ids_in_shard(tickets(ROWS), 2, 4))


def test_stop_at_failed_shard_leaves_the_shards_after_it_not_run(
    storage: Storage, instance: dg.DagsterInstance, endpoint: str
) -> None:
    endpoints = {0: endpoint, 1: dead_endpoint(), 2: endpoint, 3: endpoint}
    job = endpoint_job(storage, instance, endpoints, stop_at_failed_shard=True)

    first = ranged(job)

    assert not first.success
    assert materialized(job) == [KEYS[0]]
    message, metadata = failure(first)
    assert f"2 not run (stop_at_failed_shard): {KEYS[2]}, {KEYS[3]}." in message
    assert outcomes(metadata) == {
        KEYS[0]: "materialized",
        KEYS[1]: "failed",
        KEYS[2]: "not run",
        KEYS[3]: "not run",
    }
    assert job.computed_ids() and set(job.computed_ids()) <= set(
        ids_in_shard(tickets(ROWS), 0, 4) + ids_in_shard(tickets(ROWS), 1, 4)
    )
    # Run config turns it off for one run: every shard is tried.
    second = ranged(job, stop_at_failed_shard=False)
    assert materialized(job) == [KEYS[0], KEYS[2], KEYS[3]]
    assert outcomes(failure(second)[1])[KEYS[1]] == "failed"


def test_a_source_with_one_duplicated_id_materializes_no_shard_and_computes_nothing(
    storage: Storage, instance: dg.DagsterInstance, endpoint: str
) -> None:
    job = endpoint_job(storage, instance, dict.fromkeys(range(4), endpoint))
    df = tickets(ROWS)
    twice = ids_in_shard(df, 3, 4)[0]
    job.set_input(pl.concat([df, df.filter(pl.col("ticket_id") == twice)]))

    whole = ranged(job)
    one = job.materialize(KEYS[0], raise_on_error=False)  # a shard without the duplicate

    assert not whole.success and not one.success
    assert materialized(job) == []
    assert job.calls == []  # no row computed
    errors = [r.get_step_failure_events()[0].step_failure_data.error for r in (whole, one)]
    messages = {e.cause.message if e and e.cause else e.message if e else "" for e in errors}
    assert len(messages) == 1  # the same error for every shard
    (message,) = messages
    assert f"1 duplicated value(s) ({twice!r} at rows [{twice}, {ROWS}]" in message


def test_the_sensor_retries_exactly_the_failed_shards_in_one_ranged_run(
    storage: Storage, instance: dg.DagsterInstance, endpoint: str
) -> None:
    down = dead_endpoint()
    endpoints = {0: endpoint, 1: down, 2: down, 3: endpoint}
    job = endpoint_job(storage, instance, endpoints)
    failed = ranged(job)
    assert not failed.success and materialized(job) == [KEYS[0], KEYS[3]]
    sensor = failed_partitions_sensor(job.asset, backoff_seconds=0)
    defs = dg.Definitions(
        assets=[job.source, job.asset], sensors=[sensor], resources=job.resources()
    )

    context = dg.build_sensor_context(instance=instance, definitions=defs)
    requests = list(sensor.evaluate_tick(context).run_requests or [])

    assert len(requests) == 1  # one ranged run: the policy asks for one
    (request,) = requests
    assert request.partition_key_range == dg.PartitionKeyRange(KEYS[1], KEYS[2])
    assert request.tags[RETRY_OF_TAG] == failed.run_id
    endpoints[1] = endpoints[2] = endpoint
    job.calls.clear()
    retry = dg.materialize(
        [job.source, job.asset],
        instance=instance,
        resources=job.resources(),
        tags=request.tags,
    )
    assert retry.success and materialized(job) == KEYS
    assert sorted(job.computed_ids()) == sorted(
        ids_in_shard(tickets(ROWS), 1, 4) + ids_in_shard(tickets(ROWS), 2, 4)
    )


def test_a_ranged_run_with_its_checks_hands_them_its_result_and_each_shard_its_own_figures(
    storage: Storage, instance: dg.DagsterInstance, endpoint: str
) -> None:
    job = endpoint_job(storage, instance, dict.fromkeys(range(4), endpoint))

    result = dg.materialize(
        [job.source, job.asset, *checkpoint_checks(job.asset)],
        instance=instance,
        resources=job.resources(),
        tags=RANGE,
    )

    assert result.success
    checks = result.get_asset_check_evaluations()
    assert len(checks) == 2 and all(c.passed for c in checks)  # they read the result
    for index, key in enumerate(KEYS):
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=job.asset.key, asset_partitions=[key]), limit=5
        ).records
        # As the shard ended, then from the step's output: both with the shard's own figures.
        assert len(records) == 2
        shard_rows = len(ids_in_shard(tickets(ROWS), index, 4))
        for record in records:
            event = record.asset_materialization
            assert event is not None and event.metadata["rows_computed"].value == shard_rows
