"""A run that parses stored answers again (``parse`` changed), SIGKILLed midway, loses nothing.

It pays nothing either: the next run parses them all again, with no request, and stores each
row once.

The first run stores the answers of a 20,000-row shard. Each test then kills one real process
(``helpers/reparse_kill_child.py``) at one point of the re-parse. It runs the shard again to the
end in the test's process. The provider is the local batch provider
(``examples/llm_batch/provider.py``), which counts the requests it was sent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from helpers import reparse_kill_child as child

from checkpoint_assets.engine import Checkpoint, open_store
from examples.llm_batch.jobs import Settings
from examples.llm_batch.provider import serve, stats

CHILD = Path(child.__file__)
ROWS = 20_000


@pytest.mark.parametrize("point", child.POINTS)
def test_a_kill_while_answers_are_parsed_again_loses_nothing_and_requests_nothing(
    point: str, tmp_path: Any
) -> None:
    base_dir = str(tmp_path / "checkpoints")
    with serve(Settings()) as url:
        assert child.run_shard(url, base_dir, ROWS).rows_computed == ROWS
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        command = [sys.executable, str(CHILD), url, base_dir, str(ROWS), "parse_upper", point]
        killed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        assert killed.returncode == -9, killed.stderr[-2000:]
        again = child.run_shard(url, base_dir, ROWS, "parse_upper")
        assert again.rows_reparsed == ROWS and again.rows_computed == 0
        assert stats(url)["submitted"] == ROWS  # no request after the first run's
    stored = Checkpoint(open_store(base_dir), child.NAME).load("id").rows.sort("id")
    assert stored.height == ROWS and stored.get_column("_error").null_count() == ROWS
    # Every row's output is the changed parse's: its answer's content, upper case.
    content = stored.get_column("_answer").str.json_path_match("$.choices[0].message.content")
    assert content.null_count() == 0
    assert stored.get_column("answer").equals(content.str.to_uppercase(), check_names=False)
    assert stored.filter(pl.col("answer") == content).height == 0  # none kept the first parse's
