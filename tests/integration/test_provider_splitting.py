"""Provider batches in the engine, against the local batch provider, through OpenAI's Batch API
and Anthropic's Message Batches: a shard's rows split into submissions within the provider's
limits (requests, and bytes as each adapter counts them: an upload's lines, a create's body),
each submitted once, none refused, and the submission records on storage saying where each
stands."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import polars as pl
import pytest

from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.providers.job import ProviderJob
from checkpoint_assets.engine.providers.provider_batches import provider_loop
from checkpoint_assets.engine.providers.submission_records import Records
from checkpoint_assets.engine.providers.submissions import BatchProvider, Limits, Request, custom_id
from checkpoint_assets.resources import anthropic_batches
from checkpoint_assets.resources.anthropic_batches import AnthropicBatches
from checkpoint_assets.resources.openai_batches import OpenAIBatches
from examples.llm_batch.jobs import Settings as ProviderSettings
from examples.llm_batch.provider import serve, stats

ROWS = 1_000
#: What Anthropic's adapter keeps for the rest of a create's body beyond the requests it counts.
ENVELOPE = 256 * 1000 * 1000 - anthropic_batches.LIMITS.max_bytes


@dataclass(frozen=True)
class Api:
    """What differs between the two batch APIs, for a test: the adapter on the provider's base
    URL, how an answer is read, the provider's settings (more settings as keywords) refusing
    batches over the adapter's limits, its refusal of a batch too large (the client's error and
    status) and whether a submission uploads a file first."""

    name: str
    adapter: Callable[[str, Limits], BatchProvider]
    parse: Callable[[dict[str, Any]], dict[str, Any]]
    provider: Callable[..., ProviderSettings]
    too_large: tuple[type[Exception], int]
    uploads: bool


OPENAI = Api(
    "openai",
    lambda url, limits: OpenAIBatches(
        openai.OpenAI(base_url=url, api_key="local", max_retries=3),
        defaults={"model": "m"},
        limits=limits,
    ),
    lambda body: {"answer": body["choices"][0]["message"]["content"]},
    lambda limits, **kw: ProviderSettings(
        openai_max_requests=limits.max_requests, openai_max_bytes=limits.max_bytes, **kw
    ),
    (openai.APIStatusError, 400),
    uploads=True,
)
ANTHROPIC = Api(
    "anthropic",
    lambda url, limits: AnthropicBatches(
        anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="local"),
        {"model": "m", "max_tokens": 8},
        limits=limits,
    ),
    lambda message: {"answer": message["content"][0]["text"]},
    lambda limits, **kw: ProviderSettings(
        anthropic_max_requests=limits.max_requests,
        anthropic_max_bytes=min(limits.max_bytes + ENVELOPE, 256 * 1000 * 1000),
        **kw,
    ),
    (anthropic.APIStatusError, 413),
    uploads=False,
)
BOTH_APIS = pytest.mark.parametrize("api", [OPENAI, ANTHROPIC], ids=lambda a: a.name)


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


def _run(api: Api, adapter: BatchProvider, checkpoint: Checkpoint) -> pl.DataFrame:
    job = ProviderJob(adapter, request, api.parse, poll_seconds=0.05, max_poll_seconds=0.1)
    settings = Settings(id_column="id", input_columns=("body",), progress_seconds=1e9)
    df = pl.DataFrame({"id": range(ROWS), "body": [f"ticket {i}" for i in range(ROWS)]})
    result, _ = run(
        provider_loop(job),
        prepare(df, settings),
        checkpoint,
        settings,
        job={"t": 1},
    )
    return result


@BOTH_APIS
@pytest.mark.parametrize(
    "limits",
    [Limits(max_requests=300, max_bytes=10**9), Limits(50_000, 40_000)],
    ids=["requests", "bytes"],
)
def test_a_shard_is_split_into_batches_the_provider_accepts(
    api: Api, limits: Limits, tmp_path: Any
) -> None:
    # The provider refuses a batch over these limits: none may be refused.
    with serve(api.provider(limits, processing_delay=0.1)) as url:
        adapter = api.adapter(url, limits)
        checkpoint = Checkpoint(open_store(str(tmp_path)), "job")
        result = _run(api, adapter, checkpoint)
        counted = stats(url)
    assert counted["refused"] == 0
    assert result.height == ROWS and result.get_column("_error").null_count() == ROWS
    assert counted["processed"] == counted["submitted"] == ROWS
    records = Records(checkpoint.store, checkpoint.files).load()
    assert counted["creates"] == len(records) > 1
    assert sorted(i for r in records for i in r.ids) == list(range(ROWS))  # each row once
    assert all(r.stage == "collected" and r.batch_id for r in records)
    assert all((r.file_id is not None) == api.uploads for r in records)
    for r in records:
        assert len(r.ids) <= limits.max_requests
        sizes = [
            adapter.size(Request(custom_id(r.tag, n), request({"body": f"ticket {i}"})))
            for n, i in enumerate(r.ids)
        ]
        assert sum(sizes) <= limits.max_bytes  # its bytes, as the adapter counts them


@BOTH_APIS
def test_a_batch_over_the_byte_limit_is_refused_as_the_provider_refuses_it(
    api: Api, tmp_path: Any
) -> None:
    """The check above can fail: an adapter that undercounts the bytes is refused."""
    error, status = api.too_large
    with serve(api.provider(Limits(50_000, 40_000))) as url:
        adapter = api.adapter(url, Limits(50_000, 10**9))
        checkpoint = Checkpoint(open_store(str(tmp_path)), "job")
        with pytest.raises(error, match=r"may be at most [\d,]+ bytes") as refused:
            _run(api, adapter, checkpoint)
    assert getattr(refused.value, "status_code", None) == status
