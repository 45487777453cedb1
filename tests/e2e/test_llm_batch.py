"""The provider batch example (``examples/llm_batch``) runs unchanged against the local batch
provider, through OpenAI's Batch API and Anthropic's Message Batches: a shard submitted and
collected in one waiting run, every ticket routed once, the tokens summed; and a shard submitted
by `dagster asset materialize` (its tickets materialized in process), which ends saying what waits
and what collects it."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from examples.llm_batch.jobs import Settings
from examples.llm_batch.provider import serve, stats

MATERIALIZE = (sys.executable, "-m", "dagster", "asset", "materialize")
MATERIALIZE += ("-m", "examples.llm_batch.definitions")


@pytest.mark.parametrize("asset", ["ticket_department_openai", "ticket_department_claude"])
def test_the_example_routes_a_shard_through_each_provider(
    asset: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each batch ends as it is submitted: the run collects it at its first poll, not after
    # the example's poll_seconds (10 s). Polling a batch that runs: integration/.
    with serve(Settings(processing_delay=0)) as url:
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


@pytest.mark.slow
def test_the_cli_run_that_submits_and_ends_says_what_waits_and_what_collects_it(
    demo_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with serve(Settings(processing_delay=600)) as url:
        env = demo_env | {
            "OPENAI_BASE_URL": url,
            "OPENAI_API_KEY": "local",
            "ANTHROPIC_API_KEY": "local",
            "LLM_TICKETS": "400",
        }

        def materialize(asset: str, *partition: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*MATERIALIZE, "--select", asset, *partition],
                cwd=Path(__file__).resolve().parents[2],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )

        # The tickets in process, from the example imported under the same environment.
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        example = importlib.reload(importlib.import_module("examples.llm_batch.definitions"))
        resources = example.defs.resources
        with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
            source = dg.materialize([example.llm_tickets], instance=instance, resources=resources)
            assert source.success
        ended = materialize("ticket_department_openai", "--partition", "0-of-4")
        said = ended.stdout + ended.stderr
        assert stats(url)["creates"] == 1  # submitted once, not waited for
    # Dagster's CLI exits 1 for a run whose step failed; the failure's description says why.
    assert ended.returncode == 1
    assert "Submitted, not materialized yet: " in said
    assert "row(s) of 0-of-4 wait in 1 provider batch(es) (batch_" in said
    assert "nothing is lost, and nothing will be submitted again" in said
    assert "at the latest (its 24 h window)" in said
    assert "The sensor ticket_department_openai_provider_batches (provider_batches_sensor)" in said
