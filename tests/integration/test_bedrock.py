"""A request/parse asset through Amazon Bedrock, by real Dagster materializations with the real
``boto3`` over HTTP: the fake of Bedrock's control plane and runtime (``helpers/bedrock_fake.py``)
and S3 on moto's server. The fake counts what it ran, by row.

A 4-shard batch stores every row once, each row run once; a shard below Bedrock's minimum
records per job goes online and completes; transient record errors are sent again within the
run; a hybrid run past its deadline pays for each row once; a refused job (no room in the quota)
stops the run clearly and the next run creates it; secrets are never logged; models other than
Claude are refused."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest
from conftest import make_bucket
from helpers import bedrock_defs
from helpers.bedrock_fake import FakeBedrock, serve

from checkpoint_assets.engine import Checkpoint, open_store
from checkpoint_assets.resources.bedrock import BedrockResource
from examples.llm_batch.jobs import Settings
from examples.llm_openai.answers import classify


class Bedrock:
    """One test's world: the fake, a fresh bucket, a checkpoint root, a Dagster instance."""

    def __init__(self, fake: FakeBedrock, s3: str, base_dir: str) -> None:
        self.fake, self.s3, self.base_dir = fake, s3, base_dir
        self.bucket = make_bucket(s3)
        self.instance = dg.DagsterInstance.ephemeral()

    def resource(self, **kw: Any) -> BedrockResource:
        return bedrock_defs.resource(self.fake.url, self.s3, self.bucket, **kw)

    def materialize(
        self,
        rows: int,
        shards: int,
        partition: str,
        resource: BedrockResource | None = None,
        asset: dict[str, Any] | None = None,
        **kw: Any,
    ) -> dg.ExecuteInProcessResult:
        return dg.materialize(
            bedrock_defs.assets(rows, shards, **(asset or {})),
            instance=self.instance,
            resources=bedrock_defs.resources(self.base_dir, resource or self.resource()),
            partition_key=partition,
            **kw,
        )

    def stored(self, partition: str) -> Any:
        name = f"{bedrock_defs.ASSET}/default/{partition}"
        return Checkpoint(open_store(self.base_dir), name).load(bedrock_defs.ID).rows


@pytest.fixture
def world(s3_server: str, tmp_path: Any) -> Iterator[Bedrock]:
    with serve(s3_server) as fake:
        yield Bedrock(fake, s3_server, str(tmp_path / "checkpoints"))


def test_four_shards_store_every_row_once_and_bedrock_runs_each_once(world: Bedrock) -> None:
    rows, shards = 2_000, 4
    for i in range(shards):
        assert world.materialize(rows, shards, f"{i}-of-{shards}").success
    stored = [world.stored(f"{i}-of-{shards}") for i in range(shards)]
    ids = sorted(i for frame in stored for i in frame.get_column(bedrock_defs.ID).to_list())
    assert ids == list(range(rows))
    answers = {r["ticket_id"]: r["answer"] for frame in stored for r in frame.to_dicts()}
    assert all(answers[i] == classify(bedrock_defs.text(i)) for i in range(rows))
    counted = world.fake.stats()
    assert counted["jobs"] == shards  # one job per shard of 500 rows
    assert counted["batch_records"] == counted["paid"] == counted["rows_paid"] == rows
    assert counted["submitted_twice"] == 0 and counted["online_requests"] == 0


def test_a_shard_below_the_minimum_records_per_job_is_sent_online(
    world: Bedrock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="checkpoint_assets")
    # 240 rows in 4 shards: about 60 a shard, below Bedrock's 100 records per job.
    rows, shards = 240, 4
    result = world.materialize(rows, shards, "0-of-4")
    assert result.success
    stored = world.stored("0-of-4")
    assert stored.height > 0 and stored.get_column("_error").null_count() == stored.height
    counted = world.fake.stats()
    assert counted["jobs"] == 0  # no job: Bedrock would refuse it
    assert counted["online_requests"] == counted["paid"] == stored.height
    # Its run said why.
    assert "below Bedrock's minimum of 100 records per batch job" in caplog.text
    print(f"\nbedrock below the minimum: rows={stored.height} {counted}")  # the docs' figure (-s)


def test_transient_record_errors_are_sent_again_within_the_run(
    s3_server: str, tmp_path: Any
) -> None:
    # 2 % of a job's records fail with a 500: their rows come back as a submission below the
    # minimum, sent online; each row is paid once.
    with serve(s3_server, Settings(error_rate=0.02, seed=1)) as fake:
        world = Bedrock(fake, s3_server, str(tmp_path / "checkpoints"))
        assert world.materialize(1_000, 1, "0-of-1").success
        stored = world.stored("0-of-1")
        assert stored.height == 1_000 and stored.get_column("_error").null_count() == 1_000
        counted, errored = fake.stats(), fake.snapshot()["errored"]
        assert counted["batch_records"] == 1_000 and 0 < errored == counted["online_requests"]
        assert counted["paid"] == counted["rows_paid"] == 1_000


def test_a_hybrid_run_past_its_deadline_pays_for_each_stored_row_once(
    s3_server: str, tmp_path: Any
) -> None:
    # The job would take 4 s: at the 1 s deadline it is stopped with part of its rows run;
    # those are collected from its output, the others go online.
    with serve(s3_server, Settings(processing_delay=4.0)) as fake:
        world = Bedrock(fake, s3_server, str(tmp_path / "checkpoints"))
        config = {"ops": {bedrock_defs.ASSET: {"config": {"mode": "hybrid", "deadline": "1s"}}}}
        fast = {"max_concurrency": 8}
        assert world.materialize(1_000, 1, "0-of-1", asset=fast, run_config=config).success
        stored = world.stored("0-of-1")
        counted = fake.stats()
        assert stored.height == 1_000 == counted["paid"] == counted["rows_paid"]
        assert counted["paid_twice"] == 0
        assert 0 < counted["batch_records"] < 1_000 and counted["online_requests"] > 0
        assert fake.calls["stop"] == 1
        print(f"\nbedrock hybrid past its deadline: stored={stored.height} {counted}")  # with -s


def test_a_job_refused_for_want_of_room_waits_and_the_same_run_creates_it(
    s3_server: str, tmp_path: Any
) -> None:
    with serve(s3_server, Settings(refuse_creates=1)) as fake:
        world = Bedrock(fake, s3_server, str(tmp_path / "checkpoints"))
        assert world.materialize(500, 1, "0-of-1").success  # no red run for want of room
        counted = fake.stats()
        assert fake.calls["create"] == 2 and counted["jobs"] == 1  # refused, then created
        assert counted["paid"] == counted["rows_paid"] == 500
        stored = world.stored("0-of-1")
        assert stored.height == 500 and stored.get_column("_error").null_count() == 500


def test_credentials_are_never_logged(
    world: Bedrock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    key_id, secret = "AKIAFAKEBEDROCK00042", "bedrock-secret-do-not-log-7f3a9c"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    caplog.set_level(logging.DEBUG, logger="checkpoint_assets")
    # A resource of its own (another timeout): its clients are made now, with these credentials.
    bedrock = world.resource(timeout_seconds=59.0)
    result = world.materialize(300, 1, "0-of-1", resource=bedrock)
    assert result.success
    said = [str(e.message) for e in world.instance.all_logs(result.run_id)]
    said += [caplog.text, *capfd.readouterr(), repr(bedrock), str(bedrock.checkpoint_fingerprint())]
    for text in said:
        assert secret not in text and key_id not in text


def test_models_other_than_claude_are_refused_naming_what_is_supported() -> None:
    with pytest.raises(ValueError, match="Anthropic's Claude models"):
        BedrockResource(region="us-east-1", model_id="meta.llama3-70b-instruct-v1:0")


def test_batches_need_a_role_and_s3_prefixes() -> None:
    bedrock = BedrockResource(region="us-east-1", model_id=bedrock_defs.MODEL)
    with pytest.raises(ValueError, match="batch_role_arn, input_prefix, output_prefix"):
        bedrock.batch_provider()
