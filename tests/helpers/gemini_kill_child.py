"""Child process of the Gemini and Vertex AI kill tests: one run of one shard through Gemini's
Batch Mode or Vertex AI's batch prediction (``GeminiResource.batch_provider()`` on the fake of
``gemini_fake.py``), SIGKILLed at a point of ``provider_kill_child.POINTS``.

Usage: ``python gemini_kill_child.py CONFIG_JSON``, the JSON of :func:`run_shard`'s arguments.
The tests run the next run of the shard in their own process with :func:`run_shard`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import polars as pl

from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.providers.job import ProviderJob
from checkpoint_assets.engine.providers.provider_batches import provider_loop
from checkpoint_assets.engine.settings import RunStats
from checkpoint_assets.resources.gemini import GeminiResource

TEXTS = ("I was charged twice, please refund me", "The app crashes with an error", "hello")


def name(shard: int) -> str:
    return f"killed/default/{shard}-of-4"


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"contents": [{"role": "user", "parts": [{"text": row["body"]}]}]}


def parse(body: dict[str, Any]) -> dict[str, Any]:
    return {"answer": body["candidates"][0]["content"]["parts"][0]["text"]}


def tickets(rows: int, shard: int) -> pl.DataFrame:
    """Shard ``shard``'s rows: ids ``shard * rows`` on, each text numbered by its id."""
    ids = range(shard * rows, (shard + 1) * rows)
    return pl.DataFrame({"id": list(ids), "body": [f"{TEXTS[i % 3]} #{i}" for i in ids]})


def run_shard(
    resource: dict[str, Any], base_dir: str, rows: int, shard: int = 0, point: str = "none"
) -> RunStats:
    """One run of the shard (killed at ``point``, if it is one of ``POINTS``); ``resource``:
    the ``GeminiResource``'s fields."""
    from helpers.provider_kill_child import install

    api = GeminiResource(**resource).batch_provider()
    install(point, api, rows)
    job = ProviderJob(api, request, parse, poll_seconds=0.05, max_poll_seconds=0.2)
    settings = Settings(id_column="id", input_columns=("body",), progress_seconds=3600.0)
    checkpoint = Checkpoint(open_store(base_dir), name(shard))
    _, stats = run(
        provider_loop(job),
        prepare(tickets(rows, shard), settings),
        checkpoint,
        settings,
        job={"kill": 1},
    )
    return stats


if __name__ == "__main__":
    run_shard(**json.loads(sys.argv[1]))
