"""Anthropic's Message Batches in the engine, against the local batch provider: a shard's rows
split into message batches within Anthropic's limits (requests, and the bytes of the create's
body, which the adapter counts per request), each submitted once, and the submission records on
storage saying where each stands."""

from __future__ import annotations

from typing import Any

import anthropic
import polars as pl
import pytest

from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.provider_batches import ProviderJob, ProviderRun
from checkpoint_assets.engine.submission_records import Records
from checkpoint_assets.engine.submissions import Limits
from checkpoint_assets.resources.anthropic_batches import LIMITS, AnthropicBatches
from examples.llm_batch.jobs import Settings as ProviderSettings
from examples.llm_batch.provider import serve, stats

ROWS = 1_000
ENVELOPE = 256 * 1000 * 1000 - LIMITS.max_bytes  # what the adapter keeps for the body's rest


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


def parse(message: dict[str, Any]) -> dict[str, Any]:
    return {"answer": message["content"][0]["text"]}


@pytest.mark.parametrize(
    "limits",
    [Limits(max_requests=300, max_bytes=10**9), Limits(100_000, 40_000)],
    ids=["requests", "bytes"],
)
def test_a_shard_is_split_into_message_batches_the_provider_accepts(
    limits: Limits, tmp_path: Any
) -> None:
    # The provider refuses a batch over these limits (413 for the bytes): none may be refused.
    server = ProviderSettings(
        processing_delay=0.1,
        anthropic_max_requests=limits.max_requests,
        anthropic_max_bytes=min(limits.max_bytes + ENVELOPE, 256 * 1000 * 1000),
    )
    with serve(server) as url:
        client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="local")
        api = AnthropicBatches(client, {"model": "m", "max_tokens": 8}, limits=limits)
        job = ProviderJob(api, request, parse, poll_seconds=0.05, max_poll_seconds=0.1)
        settings = Settings(id_column="id", input_columns=("body",), progress_seconds=1e9)
        df = pl.DataFrame({"id": range(ROWS), "body": [f"ticket {i}" for i in range(ROWS)]})
        checkpoint = Checkpoint(open_store(str(tmp_path)), "job")
        result, _ = run(
            job, prepare(df, settings), checkpoint, settings, job={"t": 1}, loop=ProviderRun
        )
        counted = stats(url)
    assert counted["refused"] == 0
    assert result.height == ROWS and result.get_column("_error").null_count() == ROWS
    assert counted["processed"] == counted["submitted"] == ROWS
    records = Records(checkpoint.store, checkpoint.files).load()
    assert counted["creates"] == len(records) > 1
    assert sorted(i for r in records for i in r.ids) == list(range(ROWS))  # each row once
    assert all(r.stage == "collected" and r.batch_id and r.file_id is None for r in records)
    assert all(len(r.ids) <= limits.max_requests for r in records)


def test_a_batch_over_the_byte_limit_is_refused_as_anthropic_refuses_it(tmp_path: Any) -> None:
    """The check above can fail: an adapter that undercounts the bytes is refused (413)."""
    with serve(ProviderSettings(anthropic_max_bytes=40_000)) as url:
        client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="local")
        api = AnthropicBatches(client, {"model": "m", "max_tokens": 8}, Limits(100_000, 10**9))
        job = ProviderJob(api, request, parse, poll_seconds=0.05, max_poll_seconds=0.1)
        settings = Settings(id_column="id", input_columns=("body",), progress_seconds=1e9)
        df = pl.DataFrame({"id": range(ROWS), "body": [f"ticket {i}" for i in range(ROWS)]})
        checkpoint = Checkpoint(open_store(str(tmp_path)), "job")
        with pytest.raises(anthropic.APIStatusError, match="at most 40,000 bytes") as refused:
            run(job, prepare(df, settings), checkpoint, settings, job={"t": 1}, loop=ProviderRun)
    assert refused.value.status_code == 413
