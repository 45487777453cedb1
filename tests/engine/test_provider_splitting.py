"""Provider batches in the engine, against the local batch provider: a shard's rows split into
submissions within the provider's limits (requests and bytes), each submitted once, and the
submission records on storage saying where each stands."""

from __future__ import annotations

from typing import Any

import openai
import polars as pl
import pytest

from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.provider_batches import ProviderJob, ProviderRun
from checkpoint_assets.engine.submission_records import Records
from checkpoint_assets.engine.submissions import Limits, Request, custom_id
from checkpoint_assets.resources.openai_batches import OpenAIBatches
from examples.llm_batch.jobs import Settings as ProviderSettings
from examples.llm_batch.provider import serve, stats

ROWS = 1_000


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


def parse(body: dict[str, Any]) -> dict[str, Any]:
    return {"answer": body["choices"][0]["message"]["content"]}


@pytest.mark.parametrize(
    "limits, most",
    [(Limits(max_requests=300, max_bytes=10**9), 300), (Limits(50_000, 40_000), None)],
    ids=["requests", "bytes"],
)
def test_a_shard_is_split_within_the_providers_limits(
    limits: Limits, most: int | None, tmp_path: Any
) -> None:
    with serve(ProviderSettings(processing_delay=0.1)) as url:
        client = openai.OpenAI(base_url=url, api_key="local", max_retries=3)
        api = OpenAIBatches(client, defaults={"model": "m"}, limits=limits)
        job = ProviderJob(api, request, parse, poll_seconds=0.05, max_poll_seconds=0.1)
        settings = Settings(id_column="id", input_columns=("body",), progress_seconds=1e9)
        df = pl.DataFrame({"id": range(ROWS), "body": [f"ticket {i}" for i in range(ROWS)]})
        checkpoint = Checkpoint(open_store(str(tmp_path)), "job")
        result, _ = run(
            job, prepare(df, settings), checkpoint, settings, job={"t": 1}, loop=ProviderRun
        )
        counted = stats(url)
    assert result.height == ROWS and result.get_column("_error").null_count() == ROWS
    assert counted["processed"] == ROWS
    records = Records(checkpoint.store, checkpoint.files).load()
    assert counted["creates"] == len(records) > 1
    assert sorted(i for r in records for i in r.ids) == list(range(ROWS))  # each row once
    assert all(r.stage == "collected" and r.batch_id for r in records)
    for r in records:
        assert len(r.ids) <= (most or ROWS)
        sizes = [
            api.size(Request(custom_id(r.tag, n), request({"body": f"ticket {i}"})))
            for n, i in enumerate(r.ids)
        ]
        assert sum(sizes) <= limits.max_bytes  # the bytes of its upload
