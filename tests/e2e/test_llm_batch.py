"""The provider batch example (``examples/llm_batch``) runs unchanged against the local batch
provider, through OpenAI's Batch API and Anthropic's Message Batches: a shard submitted and
collected in one waiting run, every ticket routed once, the tokens summed."""

from __future__ import annotations

import importlib
from typing import Any

import dagster as dg
import pytest

from examples.llm_batch.jobs import Settings
from examples.llm_batch.provider import serve, stats


@pytest.mark.parametrize("asset", ["ticket_department_openai", "ticket_department_claude"])
def test_the_example_routes_a_shard_through_each_provider(
    asset: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serve(Settings(processing_delay=0.2)) as url:
        monkeypatch.setenv("OPENAI_BASE_URL", url)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", url.removesuffix("/v1"))
        monkeypatch.setenv("OPENAI_API_KEY", "local")
        monkeypatch.setenv("ANTHROPIC_API_KEY", "local")
        monkeypatch.setenv("CHECKPOINT_BASE_DIR", str(tmp_path / "checkpoints"))
        monkeypatch.setenv("LLM_TICKETS", "400")
        example = importlib.reload(importlib.import_module("examples.llm_batch.definitions"))
        defs = example.defs
        job = defs.resolve_implicit_global_asset_job_def()
        with dg.instance_for_test() as instance:
            result = job.execute_in_process(
                instance=instance,
                partition_key="0-of-4",
                asset_selection=[dg.AssetKey("llm_tickets"), dg.AssetKey(asset)],
                run_config={"ops": {asset: {"config": {"wait": True}}}},
            )
        assert result.success
        (materialization,) = result.asset_materializations_for_node(asset)
        meta = {k: v.value for k, v in materialization.metadata.items()}
        assert meta["rows_failed"] == 0 and meta["rows_computed"] == meta["rows_total"] > 50
        assert meta["usage/prompt_tokens"] > 0
        assert stats(url)["processed"] == meta["rows_total"]
