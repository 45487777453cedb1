"""A changed ``parse`` over 100,000 stored answers: no request, and its wall time against the
first run's, in the same process.

The local batch provider (``examples/llm_batch/provider.py``) runs in its own process with no
processing delay, so the first run's time is this package's and the provider's work, not a
provider's queue. Three runs of one shard through OpenAI's Batch API, on one checkpoint:

- ``first``: every row requested in batches (50,000 each), collected, each answer kept;
- ``reparse``: ``parse`` changed, the stored answers parsed again with no request;
- ``resume``: the same ``parse`` again, nothing to do: the baseline of a run's fixed costs.

Printed per run: wall and CPU seconds, the requests the provider counted (``submitted``), rows
computed and parsed again; then the merged file's size and its ``_answer`` column's share.

    python -m bench.reparse                    # 100,000 rows
    python -m bench.reparse --rows 10000       # a quick look
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
import pyarrow.parquet as pq

from bench.batches import ID, TEXT, parse, request
from checkpoint_assets.engine import Checkpoint, RunContext, Settings, open_store, prepare, run
from checkpoint_assets.engine.plan import function_fingerprint
from checkpoint_assets.engine.providers.job import ProviderJob, Way
from checkpoint_assets.engine.providers.provider_batches import provider_loop
from examples.llm_batch.provider import serve_process, stats

TEXTS = ("my invoice was charged twice", "the app crashes on start", "hello there")


def parse_changed(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "department": body["choices"][0]["message"]["content"].upper(),
        "prompt_tokens": body["usage"]["prompt_tokens"],
    }


def api(url: str) -> Any:
    import openai

    from checkpoint_assets.resources.openai_batches import OpenAIBatches

    client = openai.OpenAI(base_url=url, api_key="local", max_retries=5)
    return OpenAIBatches(client, defaults={"model": "gpt-4o-mini"})


def one_run(url: str, base_dir: str, rows: pl.DataFrame, read: Any, name: str) -> dict[str, Any]:
    """One run of the shard with ``read`` as its parse; its figures."""
    settings = Settings(
        id_column=ID, input_columns=(TEXT,), usage_columns=("prompt_tokens",), progress_seconds=1e9
    )
    job = ProviderJob(api(url), request, read, Way(), 0.2, 1.0)
    printed = function_fingerprint.of_function(request) | function_fingerprint.of_parse(read)
    checkpoint = Checkpoint(open_store(base_dir), "bench_reparse/default/00-of-1")
    before = stats(url)["submitted"]
    wall, cpu = time.perf_counter(), time.process_time()
    result, run_stats = run(
        provider_loop(job),
        prepare(rows, settings),
        checkpoint,
        settings,
        job={"bench": 1},
        context=RunContext(function_fingerprint=printed),
    )
    return {
        "run": name,
        "wall_s": round(time.perf_counter() - wall, 2),
        "cpu_s": round(time.process_time() - cpu, 2),
        "requests": stats(url)["submitted"] - before,
        "computed": run_stats.rows_computed,
        "reparsed": run_stats.rows_reparsed,
        "first_department": result.sort(ID).get_column("department")[0],
    }


def answer_share(base_dir: str) -> tuple[int, int]:
    """The merged file's bytes, and those of its ``_answer`` column (compressed)."""
    path = os.path.join(base_dir, "bench_reparse", "default", "00-of-1.parquet")
    meta = pq.ParquetFile(path).metadata
    answer = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            if group.column(c).path_in_schema == "_answer":
                answer += group.column(c).total_compressed_size
    return os.path.getsize(path), answer


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.reparse", description=__doc__)
    p.add_argument("--rows", type=int, default=100_000)
    args = p.parse_args()
    rows = pl.DataFrame({ID: range(args.rows), TEXT: [TEXTS[i % 3] for i in range(args.rows)]})
    with tempfile.TemporaryDirectory() as base_dir, serve_process() as url:
        figures = [
            one_run(url, base_dir, rows, parse, "first"),
            one_run(url, base_dir, rows, parse_changed, "reparse"),
            one_run(url, base_dir, rows, parse_changed, "resume"),
        ]
        size, answers = answer_share(base_dir)
    print(f"{args.rows:,} rows, one shard, OpenAI's Batch API against the local provider")
    print(f"{'run':<8} {'wall s':>7} {'cpu s':>7} {'requests':>9} {'computed':>9} {'reparsed':>9}")
    for f in figures:
        print(
            f"{f['run']:<8} {f['wall_s']:>7} {f['cpu_s']:>7} {f['requests']:>9,} "
            f"{f['computed']:>9,} {f['reparsed']:>9,}   ({f['first_department']})"
        )
    first, again = figures[0], figures[1]
    print(
        f"reparse / first: wall {again['wall_s'] / first['wall_s']:.2f}, "
        f"cpu {again['cpu_s'] / first['cpu_s']:.2f}"
    )
    print(
        f"merged file {size / 1e6:.1f} MB, of which _answer {answers / 1e6:.1f} MB "
        f"({answers / args.rows:.0f} bytes per answer)"
    )


if __name__ == "__main__":
    main()
