"""Answers kept: a provider batch asset stores each row's response body.

So a changed ``parse`` re-derives every output with no request. A changed request is told apart
from it.

Real Dagster materializations run against the local batch provider
(``examples/llm_batch/provider.py``): OpenAI's Batch API through the real ``openai`` client. The
provider counts the requests it was sent (``submitted``), so "no request" is counted on its side.
Each test materializes several definitions of one asset (same name and ``code_version``) over one
checkpoint on disk, as a user who edits ``parse`` between runs does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import ASSET, run_logs, stats, step_error

from checkpoint_assets import (
    AnthropicResource,
    CheckpointIOManager,
    OpenAIResource,
    provider_batch_asset,
)
from checkpoint_assets import shard_partitions as shards
from checkpoint_assets.engine import Checkpoint, open_store
from examples.llm_batch.jobs import Settings
from examples.llm_batch.provider import serve
from examples.llm_batch.provider import stats as provider_stats

ID = "ticket_id"
SHARD = "0-of-1"
TEXTS = ("I was charged twice, please refund me", "The app crashes with an error", "hello")
ANSWERS = ("billing", "technical", "other")  # the provider's rule for each of TEXTS
ROWS = 300


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


def request_with_a_system_prompt(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "Route it."}, *request(row)["messages"]]}


def parse(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "answer": body["choices"][0]["message"]["content"],
        "input_tokens": body["usage"]["prompt_tokens"],
    }


def parse_upper(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "answer": body["choices"][0]["message"]["content"].upper(),
        "input_tokens": body["usage"]["prompt_tokens"],
    }


def parse_message(message: dict[str, Any]) -> dict[str, Any]:
    return {"answer": message["content"][0]["text"]}


def parse_message_upper(message: dict[str, Any]) -> dict[str, Any]:
    return {"answer": message["content"][0]["text"].upper()}


def parse_strict(body: dict[str, Any]) -> dict[str, Any]:
    answer = body["choices"][0]["message"]["content"]
    if answer == "other":
        raise ValueError("no route")
    return {"answer": answer, "input_tokens": body["usage"]["prompt_tokens"]}


class Runs:
    """Definitions of one provider batch asset materialized over one checkpoint."""

    def __init__(self, base_dir: str, url: str) -> None:
        self.base_dir, self.url = base_dir, url
        self.instance = dg.DagsterInstance.ephemeral()
        self.df = pl.DataFrame({ID: range(ROWS), "body": [TEXTS[i % 3] for i in range(ROWS)]})

    def asset(
        self, fn: Callable[[dict[str, Any]], dict[str, Any]] = request, **kw: Any
    ) -> dg.AssetsDefinition:
        options: dict[str, Any] = {
            "source": "tickets",
            "id_column": ID,
            "parse": parse,
            "input_columns": ["body"],
            "partitions_def": shards(1),
            "usage_columns": ["input_tokens"],
            "poll_seconds": 0.05,
            "max_poll_seconds": 0.2,
            "max_failed_fraction": 1.0,
        }
        return provider_batch_asset(name=ASSET, **(options | kw))(fn)

    def __call__(
        self, asset: dg.AssetsDefinition, raise_on_error: bool = True, **config: Any
    ) -> dg.ExecuteInProcessResult:
        @dg.asset(name="tickets", io_manager_key="source_io")
        def source() -> pl.DataFrame:
            return self.df

        return dg.materialize(
            [source, asset],
            instance=self.instance,
            resources={
                "io_manager": CheckpointIOManager(base_dir=self.base_dir),
                "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
                "openai": OpenAIResource(base_url=self.url, api_key="local", model="m"),
                "claude": AnthropicResource(
                    base_url=self.url.removesuffix("/v1"),
                    api_key="local",
                    model="claude-test",
                    max_tokens=8,
                ),
            },
            partition_key=SHARD,
            run_config={"ops": {ASSET: {"config": config}}} if config else None,
            raise_on_error=raise_on_error,
        )

    def requested(self) -> int:
        """Requests the provider was sent in batches, over every run so far."""
        return provider_stats(self.url)["submitted"]

    def stored(self) -> pl.DataFrame:
        checkpoint = Checkpoint(open_store(self.base_dir), f"{ASSET}/default/{SHARD}")
        return checkpoint.load(ID).rows.sort(ID)

    def answers(self) -> list[str]:
        return self.stored().get_column("answer").to_list()


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[Runs]:
    with serve(Settings()) as url:
        yield Runs(str(tmp_path / "checkpoints"), url)


def expected(i: int) -> str:
    return ANSWERS[i % 3]


def test_a_changed_parse_rederives_every_row_from_its_stored_answer_with_no_request(
    runs: Runs,
) -> None:
    first = runs(runs.asset())
    assert first.success and runs.requested() == ROWS
    stored = runs.stored()
    body = json.loads(stored.get_column("_answer")[0])  # the response body, as compact JSON
    assert body["choices"][0]["message"]["content"] == ANSWERS[0]
    assert "_answer" not in first.output_for_node(ASSET).columns  # kept, not an output

    again = runs(runs.asset(parse=parse_upper))
    assert again.success
    assert runs.requested() == ROWS  # counted on the provider's side: no request
    assert runs.answers() == [expected(i).upper() for i in range(ROWS)]
    assert runs.stored().get_column("input_tokens").equals(stored.get_column("input_tokens"))
    meta = stats(again)
    assert meta["rows_reparsed"] == ROWS and meta["rows_without_answer"] == 0
    assert meta["calls"] == 0 and meta["rows_computed"] == 0
    assert meta["function_changes"] == "parse()'s code (no call needed)"
    logs = run_logs(again, runs.instance)
    assert any("300 stored answer(s) parsed again with no request" in line for line in logs)
    assert not any("the function changed since" in line for line in logs)  # no call needed

    quiet = runs(runs.asset(parse=parse_upper))
    assert quiet.success and stats(quiet)["function_changed"] is False
    assert runs.requested() == ROWS


def test_through_anthropic_the_kept_answer_is_the_message_and_a_changed_parse_is_free(
    runs: Runs,
) -> None:
    assert runs(runs.asset(parse=parse_message, provider="claude", usage_columns=[])).success
    message = json.loads(runs.stored().get_column("_answer")[0])
    assert message["content"][0]["text"] == ANSWERS[0]
    changed = runs.asset(parse=parse_message_upper, provider="claude", usage_columns=[])
    again = runs(changed)
    assert again.success and runs.requested() == ROWS
    assert stats(again)["rows_reparsed"] == ROWS
    assert runs.answers() == [expected(i).upper() for i in range(ROWS)]


def test_a_parse_that_raises_fails_its_rows_and_a_fixed_parse_recovers_them_free(
    runs: Runs,
) -> None:
    assert runs(runs.asset()).success
    strict = runs(runs.asset(parse=parse_strict))
    assert strict.success
    stored = runs.stored()
    failed = stored.filter(pl.col("_error").is_not_null())
    # Every third row now fails, though it was stored as a success: its answer is kept.
    assert failed.get_column(ID).to_list() == list(range(2, ROWS, 3))
    assert set(failed.get_column("_error")) == {"parse() raised ValueError: no route"}
    assert failed.get_column("_answer").null_count() == 0
    assert stats(strict)["rows_failed"] == ROWS // 3

    fixed = runs(runs.asset(parse=parse_upper))  # retry_failed is on: no request either
    assert fixed.success and runs.requested() == ROWS
    assert runs.stored().get_column("_error").null_count() == ROWS
    assert runs.answers() == [expected(i).upper() for i in range(ROWS)]


def test_a_changed_request_is_told_apart_and_kept_until_the_code_version_says_otherwise(
    runs: Runs,
) -> None:
    assert runs(runs.asset()).success
    changed = runs(runs.asset(request_with_a_system_prompt, parse=parse_upper))
    assert changed.success
    meta = stats(changed)
    assert meta["function_changes"] == (
        "request()'s code (calls needed), parse()'s code (no call needed)"
    )
    assert runs.requested() == ROWS  # today's rule: stored results are kept, and said so
    logs = run_logs(changed, runs.instance)
    assert any("the function changed since" in line for line in logs)
    assert runs.answers() == [expected(i).upper() for i in range(ROWS)]  # parse is free

    bumped = runs.asset(request_with_a_system_prompt, parse=parse_upper, code_version="2")
    assert runs(bumped, resume=False).success
    assert runs.requested() == 2 * ROWS  # the calls the changed request needs


def test_answers_kept_off_store_none_and_a_changed_parse_requests_them_only_when_asked(
    runs: Runs,
) -> None:
    assert runs(runs.asset(keep_answers=False)).success
    assert "_answer" not in runs.stored().columns

    kept = runs(runs.asset(parse=parse_upper, keep_answers=False))
    assert kept.success and runs.requested() == ROWS
    meta = stats(kept)
    assert meta["rows_reparsed"] == 0 and meta["rows_without_answer"] == ROWS
    assert runs.answers() == [expected(i) for i in range(ROWS)]  # the earlier parse's outputs
    logs = run_logs(kept, runs.instance)
    assert any("`recompute_unanswered: true`" in line for line in logs)

    # Said once, as any changed function: the next change of parse is when to ask.
    asked = runs(runs.asset(), recompute_unanswered=True)
    assert asked.success and runs.requested() == 2 * ROWS
    assert stats(asked)["rows_computed"] == ROWS
    assert runs.answers() == [expected(i) for i in range(ROWS)]
    assert runs.stored().get_column("_answer").null_count() == 0  # kept from now on


def parse_broken(body: dict[str, Any]) -> Any:
    return body["choices"][0]["message"]["content"]  # a string, not a dict of columns


def test_a_broken_parse_fails_the_run_with_its_cause_and_leaves_the_stored_rows_as_they_were(
    runs: Runs,
) -> None:
    assert runs(runs.asset()).success
    before = runs.stored()
    broken = runs(runs.asset(parse=parse_broken), raise_on_error=False)
    assert not broken.success
    assert "parse(): it returned str" in step_error(broken)
    assert runs.stored().equals(before) and runs.requested() == ROWS

    fixed = runs(runs.asset(parse=parse_upper))
    assert fixed.success and runs.requested() == ROWS
    assert runs.answers() == [expected(i).upper() for i in range(ROWS)]
