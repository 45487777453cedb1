"""Checkpoints on S3, over real HTTP to moto's server mode on 127.0.0.1.

Finalize; credentials from storage_options, ``{"env": ...}`` references, the AWS environment
chain and a dagster-aws S3Resource; errors that say which problem it is (missing bucket, denied
access, rejected credentials, unreachable endpoint) and leave stored work intact; and request
counts held to what the server really served. Crash and resume and the lock's race with real
processes run on S3, GCS and Azure alike: test_clouds.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import polars as pl
import pytest
import s3fs
from dagster_aws.s3 import S3Resource
from helpers.jobs import (
    ASSET,
    Storage,
    build_job,
    ids_in_shard,
    parts_by_partition,
    route,
    stats,
    step_error,
    tickets,
)

from checkpoint_assets import (
    CheckpointError,
    CheckpointIOManager,
    StorageError,
    checkpointed_asset,
    shard_partitions,
)
from checkpoint_assets.cli import main as cli
from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare
from checkpoint_assets.engine import run as run_engine
from checkpoint_assets.engine.sharding import keyed

NewStorage = Callable[[], Storage]


def _bucket(storage: Storage) -> str:
    return storage[0].removeprefix("s3://").split("/")[0]


# -- finalize (crash and resume, and the lock's race, on every store: test_clouds.py) ----------
def test_finalize_on_s3_leaves_the_merged_file_and_meta_only(new_s3_storage: NewStorage) -> None:
    storage = new_s3_storage()
    job = build_job(storage, tickets(100), min_flush_seconds=0)  # 24 parts, then finalize

    job.materialize()

    checkpoint = job.checkpoint()
    names = sorted(p.removeprefix(checkpoint.store.root + "/") for p in job.files())
    assert names == [f"{ASSET}/default/all.parquet", f"{ASSET}/default/all.parquet.meta.json"]
    meta = checkpoint.meta_file.read()
    assert meta is not None and meta.finalized_at is not None
    assert meta.rows == {"total": 100, "ok": 100, "failed": 0}
    assert checkpoint.read_result("ticket_id", ["route"]).height == 100


# -- request budget ----------------------------------------------------------------------------
def test_reported_storage_requests_are_what_the_server_served(
    new_s3_storage: NewStorage, moto_s3: Any
) -> None:
    storage = new_s3_storage()
    # 60 flushes: 59 parts (compaction merges eight once 56 exist), then finalize.
    job = build_job(storage, tickets(240), min_flush_seconds=0)

    metadata = stats(job.materialize())
    # One number per kind (storage_requests/put, /get, /list, /delete), as the UI plots them.
    reported = {
        key.removeprefix("storage_requests/").upper(): n
        for key, n in metadata.items()
        if key.startswith("storage_requests/") and n
    }

    served = moto_s3.requests(_bucket(storage))
    del served["BUCKET PUT"]  # the test made the bucket
    assert dict(served) == reported
    # Every write is one PUT: no server-side copies ("renames"), no multipart uploads.
    assert "COPY" not in served and "MULTIPART" not in served


def test_a_shards_reads_of_a_stored_source_on_s3_are_counted_and_fetch_only_its_slice(
    new_s3_storage: NewStorage, moto_s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keyed, "ROW_GROUP_ROWS", 512)  # 80 row groups, about 10 a shard of 8
    base_dir, options = new_s3_storage()
    bucket = _bucket((base_dir, options))
    raw = np.frombuffer(np.random.default_rng(0).bytes(40_000 * 100), dtype="S100")
    rows = tickets(40_000).with_columns(body=pl.Series(raw).bin.encode("hex"))  # incompressible

    @dg.asset(name="tickets")
    def upstream() -> pl.DataFrame:  # stored on S3 in the keyed layout
        return rows

    def routed(name: str, partitions: dg.PartitionsDefinition | None) -> dg.AssetsDefinition:
        @checkpointed_asset(
            source="tickets", id_column="ticket_id", name=name, partitions_def=partitions
        )
        def asset(batch: pl.DataFrame) -> pl.DataFrame:
            return route(batch)

        return asset

    assets = [upstream, routed("sharded", shard_partitions(8)), routed("whole", None)]
    io_manager = CheckpointIOManager(base_dir=base_dir, storage_options=options)
    job = dg.Definitions(assets=assets, resources={"io_manager": io_manager})
    run = job.resolve_implicit_global_asset_job_def().execute_in_process
    run(asset_selection=[dg.AssetKey("tickets")])
    size = s3fs.S3FileSystem(**options).size(f"{base_dir}/tickets.parquet")

    def served_while(name: str, partition: str | None) -> tuple[dict[str, int], dict[str, Any]]:
        before, sent = moto_s3.requests(bucket), moto_s3.sent(bucket)
        result = run(asset_selection=[dg.AssetKey(name)], partition_key=partition)
        (event,) = result.asset_materializations_for_node(name)
        served = moto_s3.requests(bucket)
        served.subtract(before)
        served["BYTES"] = moto_s3.sent(bucket) - sent
        return dict(+served), {k: v.value for k, v in event.metadata.items()}

    shard_served, shard = served_while("sharded", "3-of-8")
    whole_served, whole = served_while("whole", None)

    for served, metadata in ((shard_served, shard), (whole_served, whole)):
        reported = {
            key.removeprefix("storage_requests/").upper(): n
            for key, n in metadata.items()
            if key.startswith("storage_requests/") and n
        }
        assert {**reported, "BYTES": metadata["storage_bytes_read"]} == served
    # The shard's ranged GETs fetch about its eighth of the source, not the whole file.
    assert shard["storage_bytes_read"] < size / 4 < size <= whole["storage_bytes_read"]
    assert shard["rows_total"] == len(ids_in_shard(rows, 3, 8))


def test_a_ranged_run_reports_the_requests_the_server_served_for_its_shards(
    new_s3_storage: NewStorage, moto_s3: Any
) -> None:
    storage = new_s3_storage()
    job = build_job(storage, tickets(200), partitions_def=shard_partitions(4), min_flush_seconds=0)
    tags = {
        "dagster/asset_partition_range_start": "0-of-4",
        "dagster/asset_partition_range_end": "2-of-4",
    }

    result = dg.materialize(
        [job.source, job.asset], instance=job.instance, resources=job.resources(), tags=tags
    )

    shards = result.asset_materializations_for_node(ASSET)  # each shard's own requests
    assert [m.partition for m in shards] == ["0-of-4", "1-of-4", "2-of-4"]
    reported: Counter[str] = Counter()
    for shard in shards:
        requests = {
            key.removeprefix("storage_requests/").upper(): value.value
            for key, value in shard.metadata.items()
            if key.startswith("storage_requests/")
        }
        assert requests["PUT"] > 0, shard.partition  # each shard counts its own writes
        reported.update(requests)
    served = moto_s3.requests(_bucket(storage))
    del served["BUCKET PUT"]
    assert dict(served) == dict(+reported)  # the three shards' requests, each counted once


def test_a_large_file_goes_up_in_parts_of_16_mib_each_request_counted(
    new_s3_storage: NewStorage, moto_s3: Any
) -> None:
    storage = new_s3_storage()
    store = open_store(*storage)
    data = os.urandom(40 * 1024**2)  # a stored source or global resume table, written locally

    with store.put_file(store.path("tickets.parquet")) as local:
        Path(local).write_bytes(data)

    served = moto_s3.requests(_bucket(storage))
    # A multipart upload (create, three parts, complete), each request counted as a PUT.
    assert served["MULTIPART"] == 5 == store.requests["PUT"]
    assert moto_s3.largest[_bucket(storage)] <= 16 * 1024**2  # no request holds more than a part
    assert store.get(store.path("tickets.parquet")) == data


def test_min_flush_seconds_bounds_the_requests_of_a_fast_run(
    new_s3_storage: NewStorage, moto_s3: Any
) -> None:
    every_interval, spaced = new_s3_storage(), new_s3_storage()

    build_job(
        every_interval, tickets(400), checkpoint_interval=16, min_flush_seconds=0
    ).materialize()
    build_job(spaced, tickets(400), checkpoint_interval=16, min_flush_seconds=3600).materialize()

    # Flushes of 16 rows or more (rows done while a part is written join the next one).
    assert moto_s3.requests(_bucket(every_interval))["PUT"] >= 8
    few = moto_s3.requests(_bucket(spaced))
    assert few["PUT"] <= 8  # one part, the merged file, meta and lock
    assert sum(few.values()) <= 20


# -- credentials -------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint_variable", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"])
def test_the_aws_environment_chain_works_without_storage_options(
    endpoint_variable: str,
    new_s3_storage: NewStorage,
    moto_s3: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base_dir, _ = new_s3_storage()
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(endpoint_variable, moto_s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3fs.S3FileSystem.clear_instance_cache()  # a cached client would hide the environment
    try:
        result = stats(build_job((base_dir, {}), tickets(20)).materialize())
    finally:
        s3fs.S3FileSystem.clear_instance_cache()

    assert result["rows_computed"] == 20
    assert moto_s3.requests(_bucket((base_dir, {})))["PUT"] > 0


def test_storage_options_may_read_values_from_the_environment(
    new_s3_storage: NewStorage, moto_s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_dir, _ = new_s3_storage()
    monkeypatch.setenv("CKPT_ENDPOINT", moto_s3.endpoint)
    monkeypatch.setenv("CKPT_KEY", "testing")
    options: dict[str, Any] = {
        "key": {"env": "CKPT_KEY"},
        "secret": {"env": "CKPT_KEY"},
        "client_kwargs": {"endpoint_url": {"env": "CKPT_ENDPOINT"}, "region_name": "us-east-1"},
    }
    job = build_job((base_dir, options), tickets(20))

    assert stats(job.materialize())["rows_computed"] == 20
    assert moto_s3.requests(_bucket((base_dir, {})))["PUT"] > 0
    monkeypatch.delenv("CKPT_ENDPOINT")
    with pytest.raises(CheckpointError, match="CKPT_ENDPOINT"):
        job.materialize()


@dataclass
class Guarded:
    """A moto server that checks credentials and IAM policies, with bucket ``guarded``."""

    endpoint: str
    reader: tuple[str, str]  # may read and list, not write
    writer: tuple[str, str]  # may do everything on the bucket

    def storage(self, keys: tuple[str, str], prefix: str) -> Storage:
        options = {
            "key": keys[0],
            "secret": keys[1],
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
        }
        return f"s3://guarded/{prefix}", options


_GUARDED_SERVER = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def guarded() -> Iterator[Guarded]:
    """A second moto server, in its own process because moto's auth switch is process-wide."""
    import boto3

    server = subprocess.Popen(
        [sys.executable, "-c", _GUARDED_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert server.stdout is not None
        endpoint = f"http://127.0.0.1:{int(server.stdout.readline())}"
        admin = {"endpoint_url": endpoint, "region_name": "us-east-1"}
        admin |= {"aws_access_key_id": "admin", "aws_secret_access_key": "admin"}
        boto3.client("s3", **admin).create_bucket(Bucket="guarded")
        iam = boto3.client("iam", **admin)
        keys = {}
        for user, actions in (
            ("reader", ["s3:GetObject", "s3:ListBucket"]),
            ("writer", ["s3:*"]),
        ):
            iam.create_user(UserName=user)
            policy = {
                "Version": "2012-10-17",
                "Statement": [
                    {
                        "Effect": "Allow",
                        "Action": actions,
                        "Resource": ["arn:aws:s3:::guarded", "arn:aws:s3:::guarded/*"],
                    }
                ],
            }
            iam.put_user_policy(UserName=user, PolicyName=user, PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName=user)["AccessKey"]
            keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
        # From now on every request must be signed by a known key and allowed by its policy.
        enable = urllib.request.Request(
            f"{endpoint}/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(enable).read()
        yield Guarded(endpoint, keys["reader"], keys["writer"])
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(timeout=30)


def test_an_s3_resource_gives_the_io_manager_its_endpoint_and_keys(
    guarded: Guarded, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CKPT_KEY", guarded.writer[0])
    monkeypatch.setenv("CKPT_SECRET", guarded.writer[1])
    s3 = S3Resource(
        endpoint_url=guarded.endpoint,
        region_name="us-east-1",
        aws_access_key_id=dg.EnvVar("CKPT_KEY"),
        aws_secret_access_key=dg.EnvVar("CKPT_SECRET"),
    )
    base_dir = f"s3://guarded/{uuid.uuid4().hex}"
    job = build_job((base_dir, {}), tickets(20))

    @dg.asset(ins={"routed": dg.AssetIn(ASSET)}, io_manager_key="source_io")
    def downstream(routed: pl.DataFrame) -> int:
        return routed.height

    resources = {
        "io_manager": CheckpointIOManager(base_dir=base_dir, s3_resource=s3),
        "source_io": dg.InMemoryIOManager(),
        "s3": s3,
    }
    result = dg.materialize([job.source, job.asset, downstream], resources=resources)

    assert result.output_for_node("downstream") == 20
    assert stats(result)["rows_computed"] == 20


def test_an_s3_resource_with_a_local_base_dir_is_refused(tmp_path: Path) -> None:
    manager = CheckpointIOManager(base_dir=str(tmp_path), s3_resource=S3Resource())

    with pytest.raises(CheckpointError, match="not an s3:// URI"):
        manager.store()


# -- errors ------------------------------------------------------------------------------------
def test_denied_access_says_so_and_leaves_stored_work_intact(guarded: Guarded) -> None:
    prefix = uuid.uuid4().hex
    writer = build_job(guarded.storage(guarded.writer, prefix), tickets(20))
    writer.materialize()
    reader = build_job(guarded.storage(guarded.reader, prefix), tickets(40))

    with pytest.raises(StorageError, match="access was denied") as raised:
        reader.materialize()

    assert "Stored work is unchanged" in str(raised.value)
    writer.set_input(tickets(40))
    again = stats(writer.materialize())
    assert (again["rows_resumed"], again["rows_computed"]) == (20, 20)


def test_rejected_credentials_say_so(guarded: Guarded) -> None:
    job = build_job(guarded.storage(("AKIDUNKNOWN", "wrong"), uuid.uuid4().hex), tickets(5))

    with pytest.raises(StorageError, match="credentials were rejected"):
        job.materialize()


def test_a_missing_bucket_says_so_instead_of_reading_as_no_checkpoint_yet(
    new_s3_storage: NewStorage,
) -> None:
    _, options = new_s3_storage()
    storage = (f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/checkpoints", options)

    with pytest.raises(StorageError, match="the bucket does not exist"):
        build_job(storage, tickets(5)).materialize()
    with pytest.raises(StorageError, match="the bucket does not exist"):
        Checkpoint(open_store(*storage), "routed").meta_file.read()


def test_an_unreachable_endpoint_says_so_and_stored_work_survives(
    new_s3_storage: NewStorage,
) -> None:
    base_dir, options = new_s3_storage()
    job = build_job((base_dir, options), tickets(20))
    job.materialize()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    unreachable = {**options, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{closed}"}}

    with pytest.raises(StorageError, match="endpoint cannot be reached"):
        build_job((base_dir, unreachable), tickets(20), instance=job.instance).materialize()

    again = stats(job.materialize())
    assert (again["rows_resumed"], again["rows_computed"]) == (20, 0)


# -- a stored source that cannot be read is not "materialize it first" ------------------------
def _source_and_reader(storage: Storage) -> tuple[dg.AssetsDefinition, dg.AssetsDefinition]:
    """A source stored by the IO manager, and a checkpointed asset reading it."""

    @dg.asset(name="src_s3")
    def source() -> pl.DataFrame:
        return tickets(20)

    @checkpointed_asset(source="src_s3", id_column="ticket_id", name=ASSET)
    def reader(batch: pl.DataFrame) -> pl.DataFrame:
        return route(batch)

    io_manager = CheckpointIOManager(base_dir=storage[0], storage_options=storage[1])
    dg.materialize([source], resources={"io_manager": io_manager})
    return source, reader


def _read_with(
    assets: tuple[dg.AssetsDefinition, dg.AssetsDefinition], storage: Storage
) -> dg.ExecuteInProcessResult:
    """Materialize the reader alone (its source stays as stored), with ``storage``."""
    resources = {"io_manager": CheckpointIOManager(base_dir=storage[0], storage_options=storage[1])}
    return dg.materialize(
        list(assets), selection=[assets[1]], resources=resources, raise_on_error=False
    )


def _without_aws_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The process finds no AWS credentials anywhere in the standard chain."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_a_stored_source_read_without_credentials_names_them_not_a_missing_output(
    new_s3_storage: NewStorage, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    base_dir, options = new_s3_storage()
    assets = _source_and_reader((base_dir, options))
    _without_aws_credentials(monkeypatch, tmp_path)
    anonymous = {k: v for k, v in options.items() if k not in ("key", "secret")}

    error = step_error(_read_with(assets, (base_dir, anonymous)))

    assert error.startswith("StorageError: ")
    assert f"{base_dir}/src_s3.parquet" in error
    assert "no credentials were found" in error and "NoCredentialsError" in error
    assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in error
    assert "Materialize it first" not in error
    monkeypatch.undo()
    again = stats(_read_with(assets, (base_dir, options)))  # stored work is intact
    assert (again["rows_computed"], again["rows_total"]) == (20, 20)


def test_a_stored_source_read_with_rejected_credentials_says_so(guarded: Guarded) -> None:
    prefix = uuid.uuid4().hex
    assets = _source_and_reader(guarded.storage(guarded.writer, prefix))

    error = step_error(_read_with(assets, guarded.storage(("AKIDUNKNOWN", "wrong"), prefix)))

    assert error.startswith("StorageError: ")
    assert f"s3://guarded/{prefix}/src_s3.parquet" in error
    assert "check the credentials" in error
    assert "Materialize it first" not in error
    again = stats(_read_with(assets, guarded.storage(guarded.writer, prefix)))
    assert again["rows_computed"] == 20


def test_a_source_never_stored_says_to_materialize_it_first(
    new_s3_storage: NewStorage,
) -> None:
    base_dir, options = new_s3_storage()
    assets = _source_and_reader((base_dir, options))
    elsewhere = f"{base_dir}-empty"

    error = step_error(_read_with(assets, (elsewhere, options)))

    assert error.startswith("CheckpointError: ")
    assert f"No stored output for src_s3 at {elsewhere}/src_s3.parquet" in error
    assert "Materialize it first" in error


def test_operator_cli_on_s3_lists_compacts_and_verifies(
    new_s3_storage: NewStorage, capsys: pytest.CaptureFixture[str]
) -> None:
    base_dir, options = new_s3_storage()
    store = open_store(base_dir, options)
    settings = Settings(
        id_column="ticket_id",
        input_columns=("body",),
        checkpoint_interval=4,
        min_flush_seconds=0.0,
        retry_delay_seconds=0,
    )
    finished = Checkpoint(store, "a/default/0-of-2")
    run_engine(route, prepare(tickets(12), settings), finished, settings, job={})
    calls: list[int] = []

    def interrupted(batch: pl.DataFrame) -> pl.DataFrame:
        calls.append(batch.height)
        if len(calls) == 4:
            raise KeyboardInterrupt  # the 3 batches done are in parts, then it stops
        return route(batch)

    checkpoint = Checkpoint(store, "a/default/1-of-2")
    with pytest.raises(KeyboardInterrupt):
        run_engine(interrupted, prepare(tickets(32), settings), checkpoint, settings, job={})
    flags = [f"-o{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in options.items()]

    assert cli(["status", base_dir, *flags]) == 0
    # 2 or 3 parts: rows done while a part is written join the next one (group commit).
    parts = len(checkpoint.list_parts()[0])
    assert parts in (2, 3)
    assert parts_by_partition(capsys.readouterr().out) == {"0-of-2": "0", "1-of-2": str(parts)}
    assert cli(["compact", base_dir, *flags]) == 0
    assert f"1-of-2: merged {parts} part(s)" in capsys.readouterr().err
    assert checkpoint.list_parts()[0] == []
    assert cli(["verify", base_dir, *flags]) == 0
