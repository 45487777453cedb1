"""The OpenAI and Anthropic examples end to end against the local chat server over real HTTP,
with rate limits and server errors: a shard of each example materialized in process from the
example's own definitions, and a shard run by `dagster asset materialize`, SIGKILLed mid-run and
resumed (in process: the proof is about the process killed).
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import dagster as dg
import polars as pl
import pytest

from examples.llm_openai.definitions import DEPARTMENTS
from examples.llm_openai.server import Settings, serve_process, stats

ROOT = Path(__file__).resolve().parents[2]
MODULE = "examples.llm_openai.definitions"
ASSET = "ticket_department"
ANTHROPIC_MODULE = "examples.llm_anthropic.definitions"
ANTHROPIC_ASSET = "ticket_department_anthropic"


@pytest.fixture
def llm_env(demo_env: dict[str, str]) -> dict[str, str]:
    return demo_env | {"LLM_TICKETS": "1200", "OPENAI_API_KEY": "local", "OPENAI_MODEL": "m"}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    # 4% of requests refused with 429 (retry after 0.1 s), 2% failing with 500: the shard waits
    # for the former and retries the latter; 40 ms per answer. The tests read what it served
    # during their own run: the difference of its /stats.
    flaky = Settings(latency_ms=40, rate_429=0.04, retry_after_seconds=0.1, rate_500=0.02, seed=3)
    with serve_process(flaky) as base_url:
        yield base_url


@contextmanager
def _example(env: dict[str, str], *modules: str) -> Iterator[ModuleType]:
    """The last of ``modules`` imported again under ``env`` (the examples read their settings
    from the environment when imported), then again under the test's own environment."""
    try:
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            loaded = [importlib.reload(importlib.import_module(m)) for m in modules]
            yield loaded[-1]
    finally:
        for m in modules:
            importlib.reload(importlib.import_module(m))


def _run_in_process(
    example: ModuleType, env: dict[str, str], asset: str, partition: str
) -> dict[str, object]:
    """Materialize the tickets and one shard of ``asset`` in this process, on the instance of
    ``env``'s DAGSTER_HOME; the shard's materialization metadata."""
    job = example.defs.resolve_implicit_global_asset_job_def()
    with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        result = job.execute_in_process(
            instance=instance,
            partition_key=partition,
            asset_selection=[dg.AssetKey("llm_tickets"), dg.AssetKey(asset)],
        )
    assert result.success
    (materialization,) = result.asset_materializations_for_node(asset)
    assert materialization.partition == partition
    return {k: v.value for k, v in materialization.metadata.items()}


def _command(*args: str, module: str = MODULE) -> list[str]:
    return [sys.executable, "-m", "dagster", "asset", "materialize", "-m", module, *args]


def _metadata(env: dict[str, str], partition: str, asset: str = ASSET) -> dict[str, object]:
    """The latest materialization metadata of a shard, read from the instance on disk."""
    with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey(asset))
        assert event is not None and event.asset_materialization is not None
        assert event.asset_materialization.partition == partition
        return {k: v.value for k, v in event.asset_materialization.metadata.items()}


def _stored(env: dict[str, str], partition: str, asset: str = ASSET) -> pl.DataFrame:
    base = Path(env["CHECKPOINT_BASE_DIR"]) / asset / "default"
    merged = base / f"{partition}.parquet"
    frames = [pl.read_parquet(merged)] if merged.exists() else []
    # Parts only: a temporary file of a write cut short by a kill is not stored work.
    frames += [
        pl.read_parquet(p) for p in sorted(base.glob(f"{partition}.parquet.parts/*.parquet"))
    ]
    return pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()


def _served(server: str, before: dict[str, int]) -> dict[str, int]:
    """What the server served since ``before`` (an earlier /stats), by outcome."""
    return {k: v - before.get(k, 0) for k, v in stats(server).items()}


def test_a_shard_classifies_through_the_openai_client_and_sums_its_tokens(
    llm_env: dict[str, str], server: str
) -> None:
    env = llm_env | {"OPENAI_BASE_URL": server}
    before = stats(server)
    with _example(env, MODULE) as example:
        meta = _run_in_process(example, env, ASSET, "2-of-4")

    served = _served(server, before)
    stored = _stored(env, "2-of-4")
    assert stored.height == meta["rows_total"] and meta["rows_failed"] == 0
    assert stored["ticket_id"].n_unique() == stored.height
    assert set(stored["department"]) <= set(DEPARTMENTS)
    # Every answered request is a stored row; the tokens the server counted are the metadata's.
    assert served["ok"] == meta["rows_computed"] == stored.height
    assert meta["usage/prompt_tokens"] == served["prompt_tokens"]
    assert meta["usage/completion_tokens"] == served["completion_tokens"]
    assert meta["usage_total/prompt_tokens"] == served["prompt_tokens"]
    # Every 429 the server sent reached the package (no hidden retries in the client), which
    # waited and sent the call again; 4% sporadic refusals lower no concurrency.
    assert meta["throttled_calls"] == served["rate_limited"] > 0
    assert served["server_error"] > 0 and meta["calls"] > meta["rows_computed"]


def test_a_shard_killed_mid_run_resumes_without_duplicates(
    llm_env: dict[str, str], server: str
) -> None:
    env = llm_env | {"OPENAI_BASE_URL": server}
    # The source, in process: not what is killed.
    with (
        _example(env, MODULE) as example,
        dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance,
    ):
        resources = example.defs.resources
        assert dg.materialize([example.llm_tickets], instance=instance, resources=resources).success
    partition = "1-of-4"
    parts = Path(env["CHECKPOINT_BASE_DIR"]) / ASSET / "default" / f"{partition}.parquet.parts"
    before = stats(server)
    child = subprocess.Popen(
        _command("--select", ASSET, "--partition", partition),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # the CLI and whatever it starts: one group to kill
    )
    deadline = time.monotonic() + 120
    while not (parts.exists() and any(parts.glob("*.parquet"))):
        assert child.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no part was written"
        time.sleep(0.02)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    killed_with = _stored(env, partition).height
    assert killed_with > 0

    # The run after the kill, in process: what is proven is about the process killed before it.
    with (
        _example(env, MODULE) as example,
        dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance,
    ):
        again = example.defs.resolve_implicit_global_asset_job_def().execute_in_process(
            instance=instance, partition_key=partition, asset_selection=[dg.AssetKey(ASSET)]
        )
    assert again.success
    meta = _metadata(env, partition)
    stored = _stored(env, partition)
    assert meta["rows_resumed"] >= killed_with > 0
    assert stored.height == meta["rows_total"] and stored["ticket_id"].n_unique() == stored.height
    # Recomputed after the kill: what was answered but not yet durable (the loss bound: the
    # buffer and the flush being written, each within 2 intervals + the calls in flight).
    recomputed = _served(server, before)["ok"] - meta["rows_total"]
    assert 0 <= recomputed <= 2 * (2 * 64 + 32), recomputed


def test_the_anthropic_example_classifies_a_shard_and_sums_its_tokens(
    llm_env: dict[str, str],
) -> None:
    # 429s (retry after 0.1 s), 529s (overloaded, no Retry-After) and 500s, 20 ms per answer.
    flaky = Settings(
        latency_ms=20, rate_429=0.04, retry_after_seconds=0.1, rate_529=0.03, rate_500=0.02, seed=5
    )
    with serve_process(flaky) as base_url:
        env = llm_env | {
            "LLM_TICKETS": "400",
            "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),  # the anthropic client adds it
            "ANTHROPIC_API_KEY": "local",
            "ANTHROPIC_MODEL": "m",
        }
        # The OpenAI example first: the Anthropic one imports its tickets and asset arguments.
        with _example(env, MODULE, ANTHROPIC_MODULE) as example:
            meta = _run_in_process(example, env, ANTHROPIC_ASSET, "3-of-4")
        served = stats(base_url)

    stored = _stored(env, "3-of-4", ANTHROPIC_ASSET)
    assert stored.height == meta["rows_total"] == served["ok"] and meta["rows_failed"] == 0
    assert set(stored["department"]) <= set(DEPARTMENTS)
    assert meta["usage/input_tokens"] == served["prompt_tokens"]
    assert meta["usage/output_tokens"] == served["completion_tokens"] == stored.height
    # Every 429 and 529 reached the package, which waited and sent the call again.
    assert meta["throttled_calls"] == served["rate_limited"] + served["overloaded"]
    assert served["rate_limited"] > 0 and served["overloaded"] > 0 and served["server_error"] > 0
