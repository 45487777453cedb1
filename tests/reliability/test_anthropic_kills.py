"""A shard of 20,000 rows through Anthropic's Message Batches, SIGKILLed at each point of a
submission's life, then run again: every row stored once, and the provider paid once per row.

Points (``helpers/anthropic_kill_child.py``): the intent recorded and nothing sent; after the
upload step (Anthropic has none: the create is not sent); the batch created and its id not
recorded (the next run finds it by its requests' ``custom_id`` prefix, waiting for it to end);
halfway through the results; halfway through writing the collected part; the part durable and the
submission not yet marked collected. The local provider (``examples/llm_batch/provider.py``)
counts what was created, submitted, processed and downloaded. Each point takes two runs of 20,000
rows (8 to 40 s, mostly the provider's work, on a busy 2-core machine): marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from helpers.anthropic_kill_child import CHECKPOINT, ID, POINTS

from checkpoint_assets.engine import Checkpoint, open_store
from examples.llm_batch.provider import Settings, serve, stats

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the driver forks its runs")

CHILD = Path(__file__).resolve().parents[1] / "helpers" / "anthropic_kill_child.py"
REPO = Path(__file__).resolve().parents[2]
ROWS = 20_000


def drive(tmp_path: Path, base_url: str, point: str) -> list[int]:
    spec = {
        "base_url": base_url.removesuffix("/v1"),
        "base_dir": str(tmp_path / "checkpoints"),
        "rows": ROWS,
        "point": point,
        "report": str(tmp_path / "report.json"),
    }
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    subprocess.run([sys.executable, str(CHILD), str(spec_file)], env=env, check=True, timeout=240)
    statuses: list[int] = json.loads((tmp_path / "report.json").read_text())
    return statuses


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_a_kill_anywhere_pays_no_row_twice_and_stores_each_once(tmp_path: Path, point: str) -> None:
    with serve(Settings(processing_delay=0.5)) as base_url:
        killed, clean = drive(tmp_path, base_url, point)
        served = stats(base_url)

    assert killed == -9, f"the run was not killed at {point}"
    assert clean == 0, "the run after the kill failed"
    assert served["creates"] == 1, "a batch was created again"
    assert served["submitted"] == served["processed"] == served["succeeded"] == ROWS
    # Downloaded again: results read halfway or not yet stored, or read by ``find``, which
    # tells the batch created before the kill by the first line of its results.
    again = ("after_create", "while_downloading", "while_writing_part", "before_collected")
    assert served["downloads"] == (2 if point in again else 1)
    checkpoint = Checkpoint(open_store(str(tmp_path / "checkpoints")), CHECKPOINT)
    stored = checkpoint.load(ID).rows
    assert stored.height == stored.get_column(ID).n_unique() == ROWS
    assert stored.get_column("_error").null_count() == ROWS
    files = checkpoint.data_files()
    every: Any = pl.concat([pl.read_parquet(f).select(ID) for f in files])
    assert every.height == ROWS, "a row was stored twice"
