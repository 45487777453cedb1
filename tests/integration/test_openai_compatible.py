"""OpenAI-compatible servers by ``base_url``: batch APIs that differ from OpenAI's (a window,
metadata, file limits), against ``examples/llm_batch/compatible_api.py``, and a self-hosted
server (vLLM, SGLang, a LiteLLM proxy) that states no rate limits, online under a concurrency cap,
against the local chat server. The guarantees every provider holds are the contract suite's
(``test_provider_contract.py``, case ``openai_compatible``)."""

from __future__ import annotations

from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import ASSET, stats, step_error

from checkpoint_assets import CheckpointIOManager, OpenAIResource, provider_batch_asset
from examples.llm_batch.compatible_api import Compatibility, serve
from examples.llm_openai import server


def parse(body: dict[str, Any]) -> dict[str, Any]:
    return {"answer": body["choices"][0]["message"]["content"]}


def run(resource: OpenAIResource, tmp_path: Any, rows: int = 20, **kw: Any) -> Any:
    @dg.asset(name="tickets", io_manager_key="source_io")
    def tickets() -> pl.DataFrame:
        return pl.DataFrame({"id": range(rows), "body": ["hello"] * rows})

    options: dict[str, Any] = {"poll_seconds": 0.05, "max_poll_seconds": 0.2}

    @provider_batch_asset(
        name=ASSET,
        source="tickets",
        id_column="id",
        input_columns=["body"],
        parse=parse,
        **(options | kw),
    )
    def routed(row: dict[str, Any]) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": row["body"]}]}

    return dg.materialize(
        [tickets, routed],
        resources={
            "io_manager": CheckpointIOManager(base_dir=str(tmp_path / "checkpoints")),
            "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
            "openai": resource,
        },
        raise_on_error=False,
    )


def test_a_batch_api_that_refuses_metadata_says_to_turn_it_off(tmp_path: Any) -> None:
    with serve(Compatibility(metadata="refuse")) as (url, both):
        result = run(OpenAIResource(base_url=url, api_key="local", model="m"), tmp_path)
        assert not result.success
        assert "refuses the batch's metadata" in step_error(result)
        assert "set batch_metadata=False on the resource" in step_error(result)
        assert both.provider.snapshot()["creates"] == 0
        off = OpenAIResource(base_url=url, api_key="local", model="m", batch_metadata=False)
        assert run(off, tmp_path).success
        assert both.provider.snapshot()["processed"] == 20


def test_a_window_the_batch_api_refuses_names_the_setting(tmp_path: Any) -> None:
    with serve(Compatibility(windows=("24h",))) as (url, both):
        week = OpenAIResource(
            base_url=url, api_key="local", model="m", batch_completion_window="7d"
        )
        result = run(week, tmp_path)
        assert not result.success
        assert "refuses completion_window '7d'" in step_error(result)
        assert "set batch_completion_window to one it takes" in step_error(result)
        assert both.provider.snapshot()["creates"] == 0
    odd = OpenAIResource(base_url=url, api_key="local", model="m", batch_completion_window="1w")
    assert "must be hours or days such as 24h or 7d, got '1w'" in step_error(run(odd, tmp_path))


def test_a_smaller_file_limit_splits_the_rows_into_more_batches(tmp_path: Any) -> None:
    with serve(Compatibility()) as (url, both):
        small = OpenAIResource(base_url=url, api_key="local", model="m", batch_max_requests=100)
        assert run(small, tmp_path, rows=250).success
        counted = both.provider.snapshot()
        assert counted["creates"] == 3 and counted["processed"] == 250


@pytest.mark.parametrize("cap", [2, 6])
def test_a_self_hosted_server_without_rate_limit_headers_stays_under_the_concurrency_cap(
    tmp_path: Any, cap: int
) -> None:
    # vLLM and SGLang state no limits; this one refuses a request past 6 at once with a 429.
    with server.serve(latency_ms=20, max_in_flight=6, limit_headers=False) as url:
        local = OpenAIResource(base_url=url, api_key="local", model="m")
        result = run(local, tmp_path, rows=120, mode="online", max_concurrency=cap)
        assert result.success, step_error(result)
        served = server.stats(url)
    assert served["ok"] == 120 and served["rate_limited"] == 0
    assert served["peak_in_flight"] == cap  # used up to the cap, never past it
    assert stats(result)["rows_online"] == 120
