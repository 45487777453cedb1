"""Provider batches at scale: 200,000 rows in 16 shards through OpenAI's Batch API, the run that
waits against the runs that submit and end.

The local batch provider (``examples/llm_batch/provider.py``) runs in its own process with a 60 s
processing delay per batch. Each shard is a run in its own process (``--shard``), so its peak RSS
and lifetime are its own; the 16 start together, as a backfill's runs would. Two ways, one after
the other, each on fresh checkpoints:

- ``wait``: each run submits its shard and polls (5 s, doubling to 30 s) until its batch ends,
  then stores the results and finishes: the run holds its slot the whole time;
- ``submit``: each run submits, records, and ends (``BatchesPendingError``, which the Dagster
  layer turns into "Submitted, not materialized yet"); a sensor-like loop in this process polls
  the pending batches every ``--sensor-seconds`` (one request per batch still running); once a
  shard's batch ended its collecting run starts, stores the results and finishes.

With ``--error-rate`` a share of requests fail with a server error (500), which the waiting run
sends again in new batches until each row has had ``max_attempts`` (3) requests: each shard is
still one run, and the provider's ``submitted`` count is the rows plus the requests sent again.

Printed per way: the wall time to all rows stored, the run-slot seconds held (the sum of the runs'
lifetimes, what a slot-limited Dagster deployment pays, and of their time inside the run itself,
without the interpreter's start), the runs and those that ended failed (too many failed rows), the
provider's calls by kind, the storage requests of the runs, peak RSS per shard, and the rows stored
and paid (processed) so that "paid once" shows. Lifetimes include the interpreter's start
(imports), which on a busy machine is most of a short run: the load average is printed with them.

    python -m bench.batches                          # 200,000 rows, 16 shards, 60 s delay
    python -m bench.batches --rows 20000 --delay 5   # a quick look
    python -m bench.batches --rows 20000 --shards 4 --delay 5 --error-rate 0.02 --only wait
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``examples`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import polars as pl

from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.errors import BatchesPendingError, TooManyFailuresError
from checkpoint_assets.engine.providers.job import ProviderJob, Way
from checkpoint_assets.engine.providers.provider_batches import provider_loop
from checkpoint_assets.engine.providers.submission_records import Records
from checkpoint_assets.engine.providers.submissions import State
from examples.llm_batch.jobs import Settings as ProviderSettings
from examples.llm_batch.provider import serve_process, stats

ID, TEXT = "id", "text"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- one shard's run (a child process) -----------------------------------------------------
def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row[TEXT]}]}


def parse(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "department": body["choices"][0]["message"]["content"],
        "prompt_tokens": body["usage"]["prompt_tokens"],
    }


def shard_name(shard: int, shards: int) -> str:
    return f"bench_batches/default/{shard:02d}-of-{shards}"


def shard_rows(rows: int, shard: int, shards: int) -> pl.DataFrame:
    ids = list(range(shard, rows, shards))
    return pl.DataFrame({ID: ids, TEXT: [f"my invoice {i} was charged twice" for i in ids]})


def api(url: str) -> Any:
    import openai

    from checkpoint_assets.resources.openai_batches import OpenAIBatches

    client = openai.OpenAI(base_url=url, api_key="local", max_retries=5)
    return OpenAIBatches(client, defaults={"model": "gpt-4o-mini"})


def shard_main(args: argparse.Namespace) -> None:
    """One run of one shard; prints its figures as one JSON line."""
    started = time.time()
    job = ProviderJob(api(args.url), request, parse, Way(wait=args.mode != "submit"), 5.0, 30.0)
    settings = Settings(
        id_column=ID, input_columns=(TEXT,), usage_columns=("prompt_tokens",), progress_seconds=1e9
    )
    checkpoint = Checkpoint(open_store(args.base_dir), shard_name(args.shard, args.shards))
    inputs = prepare(shard_rows(args.rows, args.shard, args.shards), settings)
    pending, failed, entered = False, 0, time.time()
    try:
        _, run_stats = run(
            provider_loop(job),
            inputs,
            checkpoint,
            settings,
            job={"bench": 1},
        )
        computed = run_stats.rows_computed
    except BatchesPendingError:
        pending, computed = True, 0
    except TooManyFailuresError as e:  # the run ends failed: its shard needs another run
        failed, computed = e.failed, 0
    print(
        json.dumps(
            {
                "shard": args.shard,
                "started": started,
                "ended": time.time(),
                "run_s": time.time() - entered,
                "pending": pending,
                "rows_failed": failed,
                "rows_computed": computed,
                "storage": dict(checkpoint.store.requests),
                "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "cpu": time.process_time(),
            }
        )
    )


# -- the driver ----------------------------------------------------------------------------
def runs(
    args: argparse.Namespace, base_dir: str, url: str, mode: str, shards: list[int]
) -> list[dict[str, Any]]:
    """Run the shards' processes together; their figures."""
    command = [sys.executable, "-m", "bench.batches", "--url", url, "--base-dir", base_dir]
    common = [f"--rows={args.rows}", f"--shards={args.shards}", f"--mode={mode}"]
    children = [
        subprocess.Popen(
            [*command, *common, f"--shard={s}"], stdout=subprocess.PIPE, text=True, cwd=_REPO
        )
        for s in shards
    ]
    out = []
    for child in children:
        stdout, _ = child.communicate(timeout=3600)
        if child.returncode != 0:
            raise RuntimeError(f"a shard's run failed (exit {child.returncode})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def batch_ids(base_dir: str, shard: int, shards: int) -> list[str]:
    store = open_store(base_dir)
    records = Records(store, Checkpoint(store, shard_name(shard, shards)).files)
    return [s.batch_id for s in records.load() if s.open and s.batch_id]


def way_wait(args: argparse.Namespace, url: str, base_dir: str) -> dict[str, Any]:
    started = time.time()
    done = runs(args, base_dir, url, "wait", list(range(args.shards)))
    return figures(args, url, started, done, [], base_dir)


def way_submit(args: argparse.Namespace, url: str, base_dir: str) -> dict[str, Any]:
    started = time.time()
    submitted = runs(args, base_dir, url, "submit", list(range(args.shards)))
    waiting = {s: batch_ids(base_dir, s, args.shards) for s in range(args.shards)}
    provider = api(url)
    collected: list[dict[str, Any]] = []
    while waiting:
        time.sleep(args.sensor_seconds)
        ready = [
            s
            for s, ids in waiting.items()
            if all(provider.poll(b).state is not State.RUNNING for b in ids)
        ]
        if ready:
            collected += runs(args, base_dir, url, "collect", ready)
            for s in ready:
                del waiting[s]
    return figures(args, url, started, submitted + collected, submitted, base_dir)


def figures(
    args: argparse.Namespace,
    url: str,
    started: float,
    done: list[dict[str, Any]],
    submitting: list[dict[str, Any]],
    base_dir: str,
) -> dict[str, Any]:
    wall = max(d["ended"] for d in done) - started
    held = sum(d["ended"] - d["started"] for d in done)
    storage: dict[str, int] = {}
    for d in done:
        for kind, n in d["storage"].items():
            storage[kind] = storage.get(kind, 0) + n
    stored = 0
    for shard in range(args.shards):
        checkpoint = Checkpoint(open_store(base_dir), shard_name(shard, args.shards))
        stored += checkpoint.load(ID).rows.height
    rss = sorted(d["rss_mb"] for d in done)
    return {
        "wall_s": round(wall, 1),
        "slot_seconds": round(held, 1),
        "slot_seconds_in_run": round(sum(d["run_s"] for d in done), 1),
        "runs": len(done),
        "runs_failed": sum(1 for d in done if d["rows_failed"]),
        "rows_stored": stored,
        "rows_computed": sum(d["rows_computed"] for d in done),
        "storage_requests": storage,
        "peak_rss_mb_per_shard": {"median": rss[len(rss) // 2], "max": rss[-1]},
        "cpu_s_per_run": round(sum(d["cpu"] for d in done) / len(done), 2),
        "submit_run_s": round(max((d["ended"] - d["started"] for d in submitting), default=0), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--delay", type=float, default=60.0, help="provider processing delay (s)")
    p.add_argument("--sensor-seconds", type=float, default=10.0)
    p.add_argument("--error-rate", type=float, default=0.0, help="requests failing with 500")
    p.add_argument("--only", default="wait,submit")
    # a shard's run (internal)
    p.add_argument("--shard", type=int)
    p.add_argument("--mode")
    p.add_argument("--url")
    p.add_argument("--base-dir")
    args = p.parse_args()
    if args.shard is not None:
        shard_main(args)
        return
    print(
        f"{args.rows:,} rows, {args.shards} shards, provider delay {args.delay:g} s, "
        f"{args.error_rate:.0%} request errors; "
        f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    results: dict[str, Any] = {}
    for way in args.only.split(","):
        with (
            serve_process(
                ProviderSettings(processing_delay=args.delay, error_rate=args.error_rate)
            ) as url,
            tempfile.TemporaryDirectory() as tmp,
        ):
            results[way] = {**(way_wait if way == "wait" else way_submit)(args, url, tmp)}
            results[way]["provider"] = {
                k: v for k, v in stats(url).items() if v and k not in ("succeeded", "tokens")
            }
            print(f"{way}: {json.dumps(results[way])}", flush=True)
            print(f"  load average now {os.getloadavg()[0]:.1f}", flush=True)
    if "wait" in results and "submit" in results:
        w, s = results["wait"], results["submit"]
        print(
            f"slot seconds in runs: submit-and-end {s['slot_seconds_in_run']:.0f} vs waiting "
            f"{w['slot_seconds_in_run']:.0f} "
            f"({s['slot_seconds_in_run'] / w['slot_seconds_in_run']:.2f}x); wall "
            f"{s['wall_s']:.0f} s vs {w['wall_s']:.0f} s"
        )


if __name__ == "__main__":
    main()
