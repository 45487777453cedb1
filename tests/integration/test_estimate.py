"""The bill before the run: a dry run (``dry_run: true``) against the real run of the same job.

Both run on a real instance and real files, through ``OpenAIResource``. The endpoint is the
local chat server or the local batch provider.

How the figures can meet: the local servers count a token per whitespace-separated word
(``examples/llm_openai/answers.py`` ``count_tokens``; the batch provider alike). The estimate
counts bytes/4 (tiktoken is not installed in CI). The texts here are words of three
letters, four bytes a word with its space, about what English averages per token with OpenAI's
tokenizers. Each answer is one word, a department, and the resource's ``max_tokens`` is 1, so
the output ceiling is the answer's length.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.estimate_defs import (
    ASSET,
    ID,
    SHARDS,
    Job,
    batch_asset,
    materialized,
    online_asset,
    parse,
)
from helpers.jobs import step_error

from checkpoint_assets.integration import metadata as md
from examples.llm_batch import provider
from examples.llm_openai import server


@pytest.fixture
def chat_url() -> Iterator[str]:
    with server.serve() as url:
        yield url


@pytest.fixture
def provider_url() -> Iterator[str]:
    with provider.serve(provider.Settings()) as url:
        yield url


def near(estimated: float, actual: float) -> bool:
    return abs(estimated - actual) <= 0.15 * actual


def test_the_estimate_meets_the_real_run_rows_exactly_tokens_and_cost_within_15_percent(
    tmp_path: Path, chat_url: str
) -> None:
    job = Job(tmp_path, chat_url, online_asset())
    found = job.estimate("0-of-2")
    assert server.stats(chat_url)["requests"] == 0  # nothing was asked
    result = job.run("0-of-2")
    done = materialized(result)
    served = server.stats(chat_url)
    assert found.rows_total == done["rows_total"]
    assert found.rows_to_compute == done["rows_computed"] == served["ok"]
    assert found.rows_done == 0 and found.tokenizer == "bytes/4"
    assert near(found.input_tokens, served["prompt_tokens"])
    assert near(found.output_tokens, served["completion_tokens"])
    assert found.cost_online_usd is not None and near(found.cost_online_usd, done[md.COST_USD])
    assert found.cost_batch_usd == pytest.approx(found.cost_online_usd * 0.5)


def test_after_a_partial_run_the_estimate_counts_only_what_is_left(
    tmp_path: Path, chat_url: str
) -> None:
    job = Job(tmp_path, chat_url, online_asset())
    first = materialized(job.run("1-of-2", limit=25))
    assert first["rows_computed"] == 25
    found = job.estimate("1-of-2")
    assert found.rows_done == 25
    assert found.rows_to_compute == found.rows_total - 25
    before = server.stats(chat_url)
    rest = materialized(job.run("1-of-2"))
    after = server.stats(chat_url)
    assert found.rows_to_compute == rest["rows_computed"] == after["ok"] - before["ok"]
    asked = after["prompt_tokens"] - before["prompt_tokens"]
    assert near(found.input_tokens, asked)
    assert found.cost_online_usd is not None and near(found.cost_online_usd, rest[md.COST_USD])


def test_a_dry_run_leaves_the_checkpoint_byte_identical_and_records_no_materialization(
    tmp_path: Path, chat_url: str
) -> None:
    job = Job(tmp_path, chat_url, online_asset())
    job.run("0-of-2", limit=10)
    key = dg.AssetKey(ASSET)
    files = job.files()
    materializations = job.instance.fetch_materializations(key, limit=100).records
    found = job.estimate("0-of-2")
    assert found.rows_done == 10
    assert job.files() == files  # no lock, no meta, no part
    assert job.instance.fetch_materializations(key, limit=100).records == materializations
    status = job.instance.get_status_by_partition(key, ["0-of-2", "1-of-2"], SHARDS)
    assert status == {"0-of-2": dg.AssetPartitionStatus.MATERIALIZED, "1-of-2": None}
    # A dry run of a shard never run writes nothing either.
    job.estimate("1-of-2")
    assert job.files() == files


def test_with_dedupe_the_estimate_counts_one_row_per_distinct_input(
    tmp_path: Path, chat_url: str
) -> None:
    job = Job(tmp_path, chat_url, online_asset(dedupe=True))
    job.df = job.df.with_columns(text=pl.col("text").gather(pl.col(ID) % 10))  # 10 distinct
    found = job.estimate("0-of-2")
    done = materialized(job.run("0-of-2"))
    assert found.rows_to_compute == server.stats(chat_url)["ok"] <= 10
    assert found.rows_deduped == done["rows_reused"] == found.rows_total - found.rows_to_compute


def test_a_dry_run_fails_as_the_run_would_on_another_jobs_checkpoint(
    tmp_path: Path, chat_url: str
) -> None:
    job = Job(tmp_path, chat_url, online_asset())
    job.run("0-of-2", limit=5)
    files = job.files()
    job.asset = online_asset(code_version="v2")
    dry = job.run("0-of-2", raise_on_error=False, dry_run=True)
    real = job.run("0-of-2", raise_on_error=False)
    assert not dry.success and not real.success
    assert step_error(dry).startswith("JobChangedError: ")
    assert "code_version" in step_error(dry)
    assert step_error(dry) == step_error(real)
    assert job.files() == files


def test_provider_batches_estimate_meets_the_real_run_at_the_batch_price(
    tmp_path: Path, provider_url: str
) -> None:
    job = Job(tmp_path, provider_url, batch_asset())
    found = job.estimate("0-of-2")
    assert provider.stats(provider_url)["submitted"] == 0
    done = materialized(job.run("0-of-2"))
    paid = provider.stats(provider_url)
    assert found.rows_to_compute == done["rows_computed"] == paid["processed"]
    assert near(found.input_tokens, paid["input_tokens"])
    assert near(found.output_tokens, paid["output_tokens"])
    assert found.cost_batch_usd is not None and near(found.cost_batch_usd, done[md.COST_USD])


def test_rows_in_batches_submitted_and_not_collected_are_not_counted_again(
    tmp_path: Path,
) -> None:
    with provider.serve(provider.Settings(processing_delay=3600)) as url:
        job = Job(tmp_path, url, batch_asset(wait=False))
        assert not job.run("0-of-2", raise_on_error=False).success  # submitted, ends pending
        sent = provider.stats(url)["submitted"]
        found = job.estimate("0-of-2")
        assert found.rows_submitted == found.rows_total == sent
        assert found.rows_to_compute == found.input_tokens == 0
        assert found.cost_batch_usd == 0


def parse_odd_fails(body: dict[str, Any]) -> dict[str, Any]:
    """``parse``, failing the rows whose prompt has an odd number of words."""
    if body["usage"]["prompt_tokens"] % 2:
        raise ValueError("odd prompt")
    return parse(body)


def test_with_a_fixed_parse_rows_with_a_stored_answer_are_reparsed_not_requested(
    tmp_path: Path, provider_url: str
) -> None:
    tolerated = {"max_failed_fraction": 1.0}
    job = Job(tmp_path, provider_url, batch_asset(parse=parse_odd_fails, **tolerated))
    failed = materialized(job.run("0-of-2"))["rows_failed"]
    assert failed > 0
    sent = provider.stats(provider_url)["submitted"]
    job.asset = batch_asset(parse=parse, **tolerated)
    found = job.estimate("0-of-2")
    assert found.rows_reparsed == failed
    assert found.rows_to_compute == found.input_tokens == 0
    done = materialized(job.run("0-of-2"))
    assert done["rows_failed"] == 0
    assert provider.stats(provider_url)["submitted"] == sent  # no request
