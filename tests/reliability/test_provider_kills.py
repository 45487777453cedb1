"""A run through a provider's batch API (OpenAI's, Anthropic's) SIGKILLed at each point between
recording a submission and storing its results pays for no request twice and stores every row
once.

Each test kills one real process (``helpers/provider_kill_child.py``) of a 2,000-row shard (one
submission, its results one part) at one point, then runs the shard again to the end (in the test's
process), against the local batch provider (``examples/llm_batch/provider.py``), which counts what
it was asked: requests processed equal the rows (none submitted again), and the rows stored by the
killed run plus those the next run stored are the rows, each once. With per-request errors, a kill
while the failed requests are being sent again sends no request that had succeeded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import provider_kill_child

from checkpoint_assets.engine import Checkpoint, open_store
from examples.llm_batch.jobs import Settings
from examples.llm_batch.provider import serve, stats

CHILD = Path(provider_kill_child.__file__)
ROWS = 2_000


def child(url: str, base_dir: str, point: str, provider: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, str(CHILD), url, base_dir, str(ROWS), point, provider]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


# Both providers at the points of their adapters; the part's write and its record are
# ProviderRun's alone, whatever the provider, and run with OpenAI's.
CASES = [
    (point, provider)
    for point in provider_kill_child.POINTS
    for provider in ("openai", "anthropic")
    if provider == "openai" or point not in ("writing_part", "after_part")
]


@pytest.mark.parametrize(("point", "provider"), CASES)
def test_a_kill_at_each_point_pays_nothing_twice_and_stores_each_row_once(
    point: str, provider: str, tmp_path: Any
) -> None:
    base_dir = str(tmp_path / "checkpoints")
    with serve(Settings(processing_delay=0.2)) as url:
        killed = child(url, base_dir, point, provider)
        assert killed.returncode == -9, killed.stderr[-2000:]
        checkpoint = Checkpoint(open_store(base_dir), provider_kill_child.NAME)
        before = checkpoint.load("id").rows.height if checkpoint.meta_file.read() else 0
        run = provider_kill_child.run_shard(url, base_dir, ROWS, provider=provider)
        counted = stats(url)
        assert counted["processed"] == ROWS  # no request submitted twice
        assert counted["creates"] == 1
        assert before + run.rows_computed == ROWS  # nothing stored twice
        # Results downloaded again for rows the killed run stored are dropped, and counted.
        assert run.batch_results_dropped == before
        stored = checkpoint.load("id").rows
        assert stored.height == ROWS and stored.get_column("_error").null_count() == ROWS


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_kill_while_failed_requests_are_sent_again_sends_no_success_again(
    provider: str, tmp_path: Any
) -> None:
    base_dir = str(tmp_path / "checkpoints")
    with serve(Settings(processing_delay=0.2, error_rate=0.01)) as url:
        point = provider_kill_child.SENDING_AGAIN
        killed = child(url, base_dir, point, provider)
        assert killed.returncode == -9, killed.stderr[-2000:]
        checkpoint = Checkpoint(open_store(base_dir), provider_kill_child.NAME)
        before = checkpoint.load("id").rows.height
        assert 0 < before < ROWS  # the successes of the first batch, stored
        run = provider_kill_child.run_shard(url, base_dir, ROWS, provider=provider)
        counted = stats(url)
        stored = checkpoint.load("id").rows
        assert before + run.rows_computed == ROWS == stored.height  # each row stored once
        failed = stored.height - stored.get_column("_error").null_count()
        # Every request beyond the rows went again after an error: no success was sent twice.
        assert counted["submitted"] == counted["processed"]
        assert counted["submitted"] - ROWS == counted["errored"] - failed > 0
