"""Child process of the re-parse kill tests: one run of a shard through OpenAI's Batch API whose
``parse`` may have changed since the last, SIGKILLed at a chosen point of parsing the stored
answers again.

Usage: ``python reparse_kill_child.py BASE_URL BASE_DIR ROWS PARSE POINT``. ``PARSE`` is
``parse`` or ``parse_upper``; ``POINT`` is ``none``, ``parsing`` (the first chunk of answers
flushed, the second being parsed) or ``after_generation`` (the new generation begun, the run not
finished). The tests run the next run in their own process with ``run_shard``.
"""

from __future__ import annotations

import sys
from typing import Any

import openai
import polars as pl

from checkpoint_assets.engine import Checkpoint, RunContext, Settings, open_store, prepare, run
from checkpoint_assets.engine.loop.sink import PartWriter
from checkpoint_assets.engine.plan import function_fingerprint
from checkpoint_assets.engine.providers.job import ProviderJob
from checkpoint_assets.engine.providers.provider_batches import provider_loop
from checkpoint_assets.engine.settings import RunStats
from checkpoint_assets.resources.openai_batches import OpenAIBatches
from helpers.kills import die, parse, request

NAME = "reparsed/default/all"
POINTS = ("parsing", "after_generation")
_PARSED_BEFORE_KILL = 18_000  # past the first chunk of answers (16,384), which is flushed


def parse_upper(body: dict[str, Any]) -> dict[str, Any]:
    return {"answer": body["choices"][0]["message"]["content"].upper()}


def dying(read: Any) -> Any:
    """``read``, killing the process at its call number ``_PARSED_BEFORE_KILL``."""
    calls = [0]

    def wrapped(body: dict[str, Any]) -> dict[str, Any]:
        calls[0] += 1
        if calls[0] == _PARSED_BEFORE_KILL:
            die()
        return dict(read(body))

    return wrapped


def run_shard(
    url: str, base_dir: str, rows: int, parse_name: str = "parse", point: str = "none"
) -> RunStats:
    """One run of the shard with the ``parse_name`` parse (killed at ``point``, if it is one
    of ``POINTS``)."""
    read = {"parse": parse, "parse_upper": parse_upper}[parse_name]
    printed = function_fingerprint.of_function(request) | function_fingerprint.of_parse(read)
    if point == "parsing":
        read = dying(read)
    elif point == "after_generation":
        begin = PartWriter.begin_generation

        def begin_then_die(self: PartWriter, seq: int) -> None:
            begin(self, seq)
            die()

        PartWriter.begin_generation = begin_then_die  # type: ignore[method-assign]
    client = openai.OpenAI(base_url=url, api_key="local", max_retries=5)
    api = OpenAIBatches(client, defaults={"model": "m"})
    job = ProviderJob(api, request, read, poll_seconds=0.05, max_poll_seconds=0.2)
    settings = Settings(
        id_column="id",
        input_columns=("body",),
        progress_seconds=3600.0,
        checkpoint_interval=1000,
        min_flush_seconds=0.0,
    )
    df = pl.DataFrame({"id": range(rows), "body": [f"ticket {i}" for i in range(rows)]})
    _, stats = run(
        provider_loop(job),
        prepare(df, settings),
        Checkpoint(open_store(base_dir), NAME),
        settings,
        job={"kill": 1},
        context=RunContext(function_fingerprint=printed),
    )
    return stats


if __name__ == "__main__":
    run_shard(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
