"""A backfill through Amazon Bedrock's batch jobs whose shards are SIGKILLed after the upload,
after the create and during the download runs each row once and stores each row once.

Each killed shard is a real Dagster materialization in a child process
(``helpers/bedrock_kill_child.py``) against the fake of Bedrock (``helpers/bedrock_fake.py``),
S3 on moto's server; then every shard is materialized again in the test's process. The fake
counts every record it ran by row: none twice. It runs when ``BEDROCK_KILL_ROWS`` sets the rows
(the docs' figure is of 20,000): the provider contract suite already kills a Bedrock shard at
each of these points in every run of the tests (``test_provider_kills.py``), and this 4-shard
backfill of child processes is the figure's, too slow for every run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pytest
from conftest import make_bucket
from helpers import bedrock_defs
from helpers.bedrock_fake import serve

from checkpoint_assets.engine import Checkpoint, open_store
from checkpoint_assets.engine.providers.submissions import Request, State, custom_id

CHILD = Path(bedrock_defs.__file__).with_name("bedrock_kill_child.py")
SHARDS = 4
# The point each shard's first run is killed at; the last shard's first run is not killed.
POINTS = ("after_upload", "after_create", "downloading")


@pytest.mark.skipif(
    "BEDROCK_KILL_ROWS" not in os.environ,
    reason="the docs' figure: BEDROCK_KILL_ROWS=20000 (test_provider_kills.py has the points)",
)
def test_a_backfill_killed_after_upload_create_and_during_download_runs_each_row_once(
    s3_server: str, tmp_path: Any
) -> None:
    rows = int(os.environ["BEDROCK_KILL_ROWS"])
    base_dir = str(tmp_path / "checkpoints")
    bucket = make_bucket(s3_server)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with serve(s3_server) as fake:
        children = []  # the three killed runs, at once
        for shard, point in enumerate(POINTS):
            partition = f"{shard}-of-{SHARDS}"
            args = [fake.url, s3_server, bucket, base_dir, str(rows), str(SHARDS), partition, point]
            command = [sys.executable, str(CHILD), *args]
            children.append(subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env))
        for child in children:
            _, stderr = child.communicate(timeout=300)
            assert child.returncode == -9, stderr[-3000:]
        before = {p: stored(base_dir, p).height for p in partitions()}
        bedrock = bedrock_defs.resource(fake.url, s3_server, bucket)
        instance = dg.DagsterInstance.ephemeral()
        for partition in partitions():
            result = dg.materialize(
                bedrock_defs.assets(rows, SHARDS),
                instance=instance,
                resources=bedrock_defs.resources(base_dir, bedrock),
                partition_key=partition,
            )
            assert result.success
        counted = fake.stats()
    ids = [i for p in partitions() for i in stored(base_dir, p).get_column(bedrock_defs.ID)]
    assert sorted(ids) == list(range(rows))  # every row stored, once
    assert counted["submitted_twice"] == 0  # no record run twice, by Bedrock's count
    assert counted["batch_records"] == counted["paid"] == counted["rows_paid"] == rows
    # The kill after the upload left a file and no job: that shard's rows were submitted anew.
    # The kill after the create left a job the next run found by its name: one job a shard.
    assert counted["jobs"] == counted["creates"] == SHARDS
    # The kill during the download stored nothing of that shard: its results were read again.
    assert before["2-of-4"] == 0
    print(  # the figures the docs quote, with -s
        f"\nbedrock kills: rows={rows} stored={len(ids)} unique={len(set(ids))} "
        f"jobs={counted['jobs']} records_run={counted['batch_records']} "
        f"submitted_twice={counted['submitted_twice']} stored_before_rerun={before}"
    )


def test_a_kill_during_the_online_calls_of_a_small_submission_pays_again_only_those_in_flight(
    s3_server: str,
) -> None:
    # A submission of 60 rows, below the minimum of 100, is sent online when polled; the poll is
    # killed once 20 requests were answered. The next poll sends only those without a stored
    # answer.
    bucket = make_bucket(s3_server)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    tag = "ca" + "7" * 32
    with serve(s3_server) as fake:
        api = bedrock_defs.resource(fake.url, s3_server, bucket).batch_provider()
        requests = [
            Request(custom_id(tag, i), bedrock_defs.request({"body": bedrock_defs.text(i)}))
            for i in range(60)
        ]
        batch_id = api.create(requests, api.upload(requests, tag), tag)
        args = ["online", fake.url, s3_server, bucket, batch_id, "20"]
        killed = subprocess.run(
            [sys.executable, str(CHILD), *args], capture_output=True, text=True, env=env
        )
        assert killed.returncode == -9, killed.stderr[-3000:]
        sent_before = fake.stats()["online_requests"]
        assert 20 <= sent_before < 60
        status = api.poll(batch_id)
        results = list(api.results(batch_id))
        counted = fake.stats()
    assert status.state is State.ENDED and status.total == 60
    assert sorted(r.custom_id for r in results) == sorted(r.custom_id for r in requests)
    assert all(r.error is None for r in results)
    # Paid twice: only the requests in flight at the kill, at most the threads sending them.
    assert counted["rows_paid"] == 60 and counted["paid_twice"] <= 8
    print(f"\nbedrock online kill: sent before the kill={sent_before} {counted}")


def partitions() -> list[str]:
    return [f"{i}-of-{SHARDS}" for i in range(SHARDS)]


def stored(base_dir: str, partition: str) -> Any:
    checkpoint = Checkpoint(open_store(base_dir), f"{bedrock_defs.ASSET}/default/{partition}")
    if not checkpoint.meta_file.read():
        return pl.DataFrame({bedrock_defs.ID: []})  # killed before its checkpoint was opened
    return checkpoint.load(bedrock_defs.ID).rows
