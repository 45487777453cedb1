"""A run through a provider's batch API SIGKILLed between recording a submission and storing its
results pays for no request twice and stores every row once: every provider of the contract
suite (``helpers/provider_cases.py`` ``CASES``).

Each test kills one real process (``helpers/provider_kill_child.py``, forked from a warm server
process) running a 2,000-row shard (one submission, its results one part) at one point, then
runs the shard again to the end (in the test's process), against the provider's fake, which
counts what it was asked: requests processed equal the rows, each ``custom_id`` processed once
(none submitted again), and the rows stored by the killed run plus those the next run stored are
the rows, each once.

Every provider is killed at the points of its adapter: after the upload, after the create (the
batch's id not recorded: found again by its tag), and halfway through the download. The points
that are ``ProviderRun``'s alone, whatever the provider (before the upload, the part's write and
its record, sending failed requests again), run with OpenAI's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import provider_kill_child
from helpers.provider_cases import CASES, OPENAI, Fake, ProviderCase

from checkpoint_assets.engine import Checkpoint, open_store
from examples.llm_batch.jobs import Settings

ROWS = 2_000
#: The points of every provider's adapter.
ADAPTER_POINTS = ("after_upload", "after_create", "downloading")


@pytest.fixture
def secrets(monkeypatch: Any) -> Iterator[None]:
    for case in CASES:
        for variable, secret in case.secrets.items():
            monkeypatch.setenv(variable, secret)
    yield


def killed_then_run(case: ProviderCase, fake: Fake, base_dir: str, point: str) -> tuple[int, Any]:
    """Kill a run of the shard at ``point``, then run it to the end; the rows the killed run
    stored, and the second run's stats."""
    code, error = provider_kill_child.forked(case, fake.urls, base_dir, ROWS, point)
    assert code == -9, error[-2000:]
    checkpoint = Checkpoint(open_store(base_dir), provider_kill_child.NAME)
    before = checkpoint.load("id").rows.height if checkpoint.meta_file.read() else 0
    return before, provider_kill_child.run_shard(case, fake.urls, base_dir, ROWS)


def stored_once(base_dir: str, fake: Fake, before: int, computed: int) -> None:
    counted = fake.counts()
    assert counted["processed"] == ROWS  # no request submitted twice ...
    assert max(fake.processed().values()) == 1  # ... by the provider's own count
    assert counted["creates"] == 1
    assert before + computed == ROWS  # nothing stored twice
    stored = Checkpoint(open_store(base_dir), provider_kill_child.NAME).load("id").rows
    assert stored.height == ROWS and stored.get_column("_error").null_count() == ROWS


@pytest.mark.usefixtures("secrets")
@pytest.mark.parametrize("point", ADAPTER_POINTS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_kill_in_the_providers_adapter_pays_nothing_twice_and_stores_each_row_once(
    case: ProviderCase, point: str, tmp_path: Any
) -> None:
    base_dir = str(tmp_path / "checkpoints")
    with case.start(Settings(processing_delay=0.2), time.time) as fake:
        before, run = killed_then_run(case, fake, base_dir, point)
        stored_once(base_dir, fake, before, run.rows_computed)
        # Results downloaded again for rows the killed run stored are dropped, and counted.
        assert run.batch_results_dropped == before


@pytest.mark.usefixtures("secrets")
@pytest.mark.parametrize("point", ["before_upload", "writing_part", "after_part"])
def test_a_kill_in_the_run_loop_pays_nothing_twice_and_stores_each_row_once(
    point: str, tmp_path: Any
) -> None:
    base_dir = str(tmp_path / "checkpoints")
    with OPENAI.start(Settings(processing_delay=0.2), time.time) as fake:
        before, run = killed_then_run(OPENAI, fake, base_dir, point)
        stored_once(base_dir, fake, before, run.rows_computed)
        assert run.batch_results_dropped == before


@pytest.mark.usefixtures("secrets")
def test_a_kill_while_failed_requests_are_sent_again_sends_no_success_again(
    tmp_path: Any,
) -> None:
    base_dir = str(tmp_path / "checkpoints")
    with OPENAI.start(Settings(processing_delay=0.2, error_rate=0.01), time.time) as fake:
        before, run = killed_then_run(OPENAI, fake, base_dir, provider_kill_child.SENDING_AGAIN)
        assert 0 < before < ROWS  # the successes of the first batch, stored
        counted = fake.counts()
        stored = Checkpoint(open_store(base_dir), provider_kill_child.NAME).load("id").rows
        assert before + run.rows_computed == ROWS == stored.height  # each row stored once
        failed = stored.height - stored.get_column("_error").null_count()
        # Every request beyond the rows went again after an error: no success was sent twice.
        assert counted["submitted"] == counted["processed"]
        assert counted["submitted"] - ROWS == counted["errored"] - failed > 0
        assert max(fake.processed().values()) == 1
