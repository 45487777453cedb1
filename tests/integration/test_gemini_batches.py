"""``provider_batch_asset`` through Gemini's batch APIs, with ``GeminiResource``: the Gemini
API's Batch Mode (inline requests, and a JSONL file through the Files API) and Vertex AI's batch
prediction (JSONL on Cloud Storage, here fake-gcs-server, with application default credentials
from a service account key file whose tokens the fake gives).

Real Dagster materializations, the real ``google-genai`` client over HTTP to the fake of
``helpers/gemini_fake.py``, which counts every request it answered (``processed``) and every row
it answered more than once (``paid_twice``). What every provider guarantees (expiry, transient
errors, cancel, hybrid, kills...) is the contract suite's (``helpers/provider_cases.py``); here is
what is Gemini's own: both ways of Batch Mode and Vertex across shards, the 429's
``retryDelay``, and the settings and requests Gemini cannot take.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import dagster as dg
import polars as pl
import pytest

if importlib.util.find_spec("google.genai") is None:  # optional extra; CI must have it
    if os.environ.get("CI") == "true":
        pytest.fail("pip install -e '.[gemini]'", pytrace=False)
    pytest.skip("pip install -e '.[gemini]'", allow_module_level=True)

from helpers.gemini_fake import Fake, Settings, serve, service_account_file
from helpers.jobs import ASSET, stats, step_error

from checkpoint_assets import (
    CheckpointIOManager,
    GeminiResource,
    provider_batch_asset,
    shard_partitions,
)
from checkpoint_assets.engine import Checkpoint, open_store
from checkpoint_assets.resources.gemini import GeminiRateLimitedError, retry_delay_seconds

ID = "ticket_id"
TEXTS = ("I was charged twice, please refund me", "The app crashes with an error", "hello")
ANSWERS = ("billing", "technical", "other")
BACKENDS = ("gemini", "gemini_file", "vertex")


def parse(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "answer": body["candidates"][0]["content"]["parts"][0]["text"],
        "input_tokens": body["usageMetadata"]["promptTokenCount"],
    }


@dataclass
class Setup:
    """One backend on a fresh fake: the resource's fields, the fake, the checkpoints' root."""

    backend: str
    fake: Fake
    fields: dict[str, Any]
    base_dir: str
    rows: int

    def __post_init__(self) -> None:
        ids = range(self.rows)
        self.df = pl.DataFrame({ID: list(ids), "body": [f"{TEXTS[i % 3]} #{i}" for i in ids]})
        self.instance = dg.DagsterInstance.ephemeral()

    def asset(self, shards: int = 1, **kw: Any) -> dg.AssetsDefinition:
        options: dict[str, Any] = {
            "source": "tickets",
            "id_column": ID,
            "parse": parse,
            "provider": "gemini",
            "input_columns": ["body"],
            "partitions_def": shard_partitions(shards),
            "usage_columns": ["input_tokens"],
            "poll_seconds": 0.05,
            "max_poll_seconds": 0.2,
            "max_concurrency": 8,
        }

        @provider_batch_asset(name=ASSET, **(options | kw))
        def routed(row: dict[str, Any]) -> dict[str, Any]:
            return {"contents": [{"role": "user", "parts": [{"text": row["body"]}]}]}

        return routed

    def materialize(
        self, asset: dg.AssetsDefinition, partition: str = "0-of-1", **config: Any
    ) -> dg.ExecuteInProcessResult:
        @dg.asset(name="tickets", io_manager_key="source_io")
        def tickets() -> pl.DataFrame:
            return self.df

        return dg.materialize(
            [tickets, asset],
            instance=self.instance,
            resources={
                "io_manager": CheckpointIOManager(base_dir=self.base_dir),
                "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
                "gemini": GeminiResource(**self.fields),
            },
            partition_key=partition,
            run_config={"ops": {ASSET: {"config": config}}},
            raise_on_error=False,
        )

    def stored(self, partitions: list[str]) -> pl.DataFrame:
        """Every row of every part and merged file of the partitions, unresolved: a row stored
        twice shows."""
        store = open_store(self.base_dir)
        files = [
            f for p in partitions for f in Checkpoint(store, f"{ASSET}/default/{p}").data_files()
        ]
        return pl.concat([pl.read_parquet(f) for f in files])

    def stored_once(self, partitions: list[str]) -> pl.DataFrame:
        rows = self.stored(partitions)
        assert rows.height == rows.get_column(ID).n_unique() == self.rows
        assert rows.get_column("_error").null_count() == self.rows
        answers = rows.sort(ID).get_column("answer").to_list()
        assert answers == [ANSWERS[i % 3] for i in range(self.rows)]
        return rows


@pytest.fixture
def setup(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Setup]:
    """The backend of the test's ``backend`` parameter (default ``gemini``) on a fake with the
    settings of its ``provider`` marker: ``rows`` (default 100), the fake's online options,
    the batch ``Settings``."""
    backend = getattr(request, "param", "gemini")
    marker = request.node.get_closest_marker("provider")
    options = dict(marker.kwargs) if marker else {}
    rows = options.pop("rows", 100)
    online = {k: options.pop(k) for k in ("rate_limit_every", "retry_delay") if k in options}
    if backend == "vertex":
        gcs = request.getfixturevalue("gcs_server")
        storage, gcs_options = gcs.new_storage()
        online["storage_options"] = gcs_options
    with serve(Settings(**options), **online) as (url, fake):
        fields: dict[str, Any] = {"model": "gemini-test", "base_url": url}
        if backend == "vertex":
            credentials = service_account_file(str(tmp_path / "key.json"), url)
            monkeypatch = request.getfixturevalue("monkeypatch")
            monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", credentials)
            fields |= {
                "vertexai": True,
                "project": "test-project",
                "location": "us-central1",
                "gcs_prefix": storage.replace("/checkpoints", "/batches"),
                "storage_options": gcs_options,
            }
        else:
            fields["api_key"] = "local"
            if backend == "gemini_file":
                fields["inline_max_bytes"] = 1  # every submission goes as a file
        yield Setup(backend, fake, fields, str(tmp_path / "checkpoints"), rows)


each_backend = pytest.mark.parametrize("setup", BACKENDS, indirect=True)
batch_backends = pytest.mark.parametrize("setup", ["gemini", "vertex"], indirect=True)


@each_backend
@pytest.mark.provider(rows=400, processing_delay=0.1)
def test_a_backfill_of_four_shards_stores_every_row_once_and_pays_each_once(
    setup: Setup,
) -> None:
    asset = setup.asset(shards=4)
    partitions = [f"{i}-of-4" for i in range(4)]
    for partition in partitions:
        result = setup.materialize(asset, partition)
        assert result.success, step_error(result)
        assert stats(result)["mode"] == "batch"
    counted = setup.fake.snapshot()
    assert counted["creates"] == 4  # one job per shard
    assert counted["processed"] == 400 and counted["paid_twice"] == 0
    assert counted.get("uploads", 0) == (4 if setup.backend == "gemini_file" else 0)
    rows = setup.stored_once(partitions)
    # Each row keeps the response body it was parsed from.
    assert parse(json.loads(rows.sort(ID).get_column("_answer")[0]))["answer"] == "billing"


@pytest.mark.parametrize("setup", ["gemini", "vertex"], indirect=True)
@pytest.mark.provider(rows=60, rate_limit_every=7, retry_delay=1.5)  # past the 1 s back-off
def test_online_rows_wait_the_retry_delay_of_a_429_and_fail_none(setup: Setup) -> None:
    result = setup.materialize(setup.asset(max_concurrency=4), mode="online")
    assert result.success, step_error(result)
    counted = setup.fake.snapshot()
    assert counted["rate_limited"] >= 5
    assert counted.get("early", 0) == 0  # no refused request sent again before its retryDelay
    assert counted["ok"] == 60 and counted["processed"] == 0  # each row paid once, online
    setup.stored_once(["0-of-1"])
    assert stats(result)["rows_online"] == 60


def test_a_429_becomes_a_refusal_with_its_retry_delay() -> None:
    body = {
        "error": {
            "code": 429,
            "status": "RESOURCE_EXHAUSTED",
            "details": [
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "2.5s"}
            ],
        }
    }
    assert retry_delay_seconds(body) == 2.5
    assert retry_delay_seconds({"error": {"code": 429}}) is None
    refused = GeminiRateLimitedError(2.5, "429")
    assert (refused.response.status_code, refused.response.headers) == (429, {"retry-after": "2.5"})


def test_settings_that_cannot_work_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="needs api_key for the Gemini API"):
        GeminiResource(model="m").batch_provider()
    vertex = {"model": "m", "vertexai": True, "project": "p", "location": "us-central1"}
    for prefix in (None, "bq://p.dataset.table"):
        with pytest.raises(ValueError, match="set gcs_prefix to a gs:// prefix") as e:
            GeminiResource(**vertex, gcs_prefix=prefix).batch_provider()
        assert "BigQuery tables (bq://) are not taken" in str(e.value)
    with pytest.raises(ValueError, match="generateContent requests only"):
        GeminiResource(model="m", api_key="k").sender("/v1/chat/completions")


@each_backend
def test_a_request_gemini_cannot_take_is_a_clear_error_before_anything_is_sent(
    setup: Setup,
) -> None:
    @provider_batch_asset(
        name=ASSET,
        source="tickets",
        id_column=ID,
        parse=parse,
        provider="gemini",
        input_columns=["body"],
        partitions_def=shard_partitions(1),
        poll_seconds=0.05,
    )
    def routed(row: dict[str, Any]) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": row["body"]}]}  # OpenAI's shape

    result = setup.materialize(routed)
    assert not result.success
    assert "fields that a GenerateContentRequest does not have: ['messages']" in step_error(result)
    assert setup.fake.snapshot().get("creates", 0) == 0


@pytest.mark.parametrize(
    ("message", "kind", "limit"),
    [
        ("You have reached the limit of 100 concurrent batch jobs.", "concurrent_jobs", 100),
        (
            "Enqueued token limit: 2,000,000 tokens for gemini-2.5-flash",
            "enqueued_tokens",
            2_000_000,
        ),
        ("Quota exceeded: limit of 8 concurrent batch prediction jobs.", "concurrent_jobs", 8),
        ("Resource has been exhausted (e.g. check quota).", "concurrent_jobs", None),
    ],
)
def test_a_429_on_create_is_a_full_queue_with_its_kind_limit_and_retry_delay(
    message: str, kind: str, limit: int | None
) -> None:
    from google.genai import errors

    from checkpoint_assets.engine.providers.submissions import QueueFull
    from checkpoint_assets.resources.gemini_batches import _queue_full

    retry = {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "37s"}
    body = {"error": {"code": 429, "message": message, "status": "RESOURCE_EXHAUSTED"}}
    body["error"]["details"] = [retry]
    refusal = _queue_full(errors.ClientError(429, body), "gemini-test")
    assert isinstance(refusal, QueueFull)
    assert refusal.kind == kind and refusal.retry_after == 37.0
    assert refusal.stated == ({kind: limit} if limit else {})
    assert not isinstance(_queue_full(errors.ClientError(400, body), "m"), QueueFull)
