"""One request/parse job run three ways over the same rows: ``online``, ``batch`` and ``hybrid``
(batches, then online after a deadline shorter than the provider's processing delay).

The local batch provider and chat server answer on one base URL (``examples/llm_batch/online.py``),
in a thread of this process, fresh for each mode. Each mode runs one shard on its own
checkpoint through ``OpenAIResource``, at the engine level (no Dagster). Printed per mode: wall
and CPU seconds, the requests answered by batch (``processed``) and online (``ok``), their sum
(the requests paid), the batch requests the cancel left unrun, the rows stored and distinct ids,
and ``batch_results_dropped``.

    python -m bench.modes                                   # 2,000 rows, 20 s delay, 5 s deadline
    python -m bench.modes --rows 500 --delay 5 --deadline 1
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``examples`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import polars as pl

from bench.batches import ID, TEXT, parse, request
from checkpoint_assets import OpenAIResource
from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.providers.job import Mode, ProviderJob, Way
from checkpoint_assets.engine.providers.provider_batches import provider_loop
from examples.llm_batch import jobs
from examples.llm_batch.online import serve

TEXTS = ("my invoice was charged twice", "the app crashes on start", "hello there")


def one_mode(mode: Mode, rows: pl.DataFrame, delay: float, deadline: float) -> dict[str, Any]:
    """One run of the shard in ``mode``, against fresh servers; its figures."""
    settings = Settings(
        id_column=ID,
        input_columns=(TEXT,),
        usage_columns=("prompt_tokens",),
        max_concurrency=16,
        checkpoint_interval=256,
        progress_seconds=1e9,
    )
    with tempfile.TemporaryDirectory() as base_dir, serve(jobs.Settings(delay)) as (url, both):
        resource = OpenAIResource(base_url=url, api_key="local", model="gpt-4o-mini")
        job = ProviderJob(
            resource.batch_provider(),
            request,
            parse,
            poll_seconds=0.2,
            max_poll_seconds=1.0,
            way=Way(mode, deadline if mode is Mode.hybrid else None),
            send=None if mode is Mode.batch else resource.sender(),
        )
        checkpoint = Checkpoint(open_store(base_dir), "bench_modes/default/00-of-1")
        wall, cpu = time.perf_counter(), time.process_time()
        _, stats = run(
            provider_loop(job),
            prepare(rows, settings),
            checkpoint,
            settings,
            job={"bench": 1},
        )
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        stored = checkpoint.load(ID).rows
        provider, chat = both.provider.snapshot(), both.chat.snapshot()
        return {
            "mode": mode.value,
            "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1),
            "batch": provider["processed"],
            "online": chat["ok"],
            "paid": both.paid(),
            "cancelled": provider["cancelled"],
            "stored": stored.height,
            "ids": stored.get_column(ID).n_unique(),
            "dropped": stats.batch_results_dropped,
        }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.modes", description=__doc__)
    p.add_argument("--rows", type=int, default=2_000)
    p.add_argument("--delay", type=float, default=20.0, help="the provider's processing delay")
    p.add_argument("--deadline", type=float, default=5.0, help="hybrid's deadline, seconds")
    args = p.parse_args()
    rows = pl.DataFrame({ID: range(args.rows), TEXT: [TEXTS[i % 3] for i in range(args.rows)]})
    figures = [one_mode(m, rows, args.delay, args.deadline) for m in Mode]
    print(
        f"{args.rows:,} rows, one shard; provider delay {args.delay:g} s, "
        f"hybrid deadline {args.deadline:g} s"
    )
    columns = list(figures[0])
    print("  ".join(f"{c:>9}" for c in columns))
    for f in figures:
        print("  ".join(f"{f[c]:>9}" for c in columns))


if __name__ == "__main__":
    main()
