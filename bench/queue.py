"""Provider batches against a queue that holds about one shard: a backfill's shards submitting at
once, through the real ``openai`` and ``anthropic`` clients, to ``bench/queue_provider.py`` (a
server written apart from the package, in its own process).

The queue holds the largest shard's submission: OpenAI's enqueued tokens (learned from the first
refusal's message, which states the limit), or Anthropic's queued requests (its 429 states no
number). Each shard is a run in its own process, started together as a backfill's runs are, on
one checkpoint store. Two ways:

- ``wait``: each run submits what the queue has room for, waits for room for the rest, and
  finishes. Printed: runs that ended red, failed rows, refused submissions (recorded, and the
  server's count), the queue's use from the first create to the last batch's end, and its peak.
- ``sensor``: each run submits what has room and ends (``wait: false``); a loop in this process
  does what ``provider_batches_sensor`` does each tick: a partition whose batches have all ended
  gets a run, and so does one partition whose rows wait for room for each of those (the longest
  waiting first). Printed
  as above, with the runs each shard took.

And ``split``: one shard of 200,000 rows submitted to a queue without limit, its submissions
checked against OpenAI's 50,000 requests and 200 MB per file.

    python -m bench.queue                                   # 4 and 16 shards, both APIs, both ways
    python -m bench.queue --shards 4 --apis openai --ways wait
    python -m bench.queue --ways split
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import polars as pl

from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.errors import BatchesPendingError
from checkpoint_assets.engine.providers.job import ProviderJob, Way
from checkpoint_assets.engine.providers.provider_batches import provider_loop
from checkpoint_assets.engine.providers.submission_records import Records
from checkpoint_assets.engine.providers.submissions import State

ID, TEXT = "id", "text"
ROWS_PER_SHARD = 1_200
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def text(i: int) -> str:
    return f"ticket {i}: " + "please refund my second payment " * (1 + i % 4)


def shard_rows(shard: int, shards: int) -> pl.DataFrame:
    ids = list(range(shard, ROWS_PER_SHARD * shards, shards))
    return pl.DataFrame({ID: ids, TEXT: [text(i) for i in ids]})


def tokens_of(shard: int, shards: int) -> int:
    return sum(-(-len(t) // 4) for t in shard_rows(shard, shards).get_column(TEXT))


def name(shard: int, shards: int) -> str:
    return f"bench_queue/default/{shard:02d}-of-{shards}"


def adapter(api: str, url: str) -> Any:
    if api == "openai":
        import openai

        from checkpoint_assets.resources.openai_batches import OpenAIBatches

        client = openai.OpenAI(base_url=url, api_key="local", max_retries=5)
        return OpenAIBatches(client, defaults={"model": "gpt-4o-mini"})
    import anthropic

    from checkpoint_assets.resources.anthropic_batches import AnthropicBatches

    claude = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="local", max_retries=2)
    return AnthropicBatches(claude, {"model": "claude-haiku-4-5", "max_tokens": 16})


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row[TEXT]}]}


def parse(body: dict[str, Any]) -> dict[str, Any]:
    if "choices" in body:
        return {"answer": body["choices"][0]["message"]["content"]}
    return {"answer": body["content"][0]["text"]}


# -- one shard's run (a child process) -------------------------------------------------------
def shard_main(args: argparse.Namespace) -> None:
    started = time.time()
    job = ProviderJob(
        adapter(args.api, args.url), request, parse, Way(wait=args.wait == "true"), 0.5, 1.0
    )
    settings = Settings(id_column=ID, input_columns=(TEXT,), progress_seconds=1e9)
    checkpoint = Checkpoint(open_store(args.base_dir), name(args.shard, args.shards))
    rows = shard_rows(args.shard, args.shards)
    if args.rows:
        rows = pl.DataFrame({ID: list(range(args.rows)), TEXT: [text(i) for i in range(args.rows)]})
    inputs = prepare(rows, settings)
    out: dict[str, Any] = {"shard": args.shard, "started": started, "red": False}
    try:
        _, stats = run(
            provider_loop(job),
            inputs,
            checkpoint,
            settings,
            job={"bench": 1},
        )
        out |= {"finished": True, "queue_wait_s": stats.queue_wait_seconds}
        out |= {"refused": stats.submissions_refused, "failed": stats.rows_failed}
    except BatchesPendingError as e:
        out |= {"finished": False, "unsubmitted": e.unsubmitted, "pending": e.rows}
    except Exception as e:  # a red run
        out |= {"finished": False, "red": True, "error": f"{type(e).__name__}: {e}"}
    out["ended"] = time.time()
    print(json.dumps(out))


# -- the driver --------------------------------------------------------------------------------
def start(
    args: argparse.Namespace,
    api: str,
    url: str,
    base: str,
    wait: bool,
    shards: int,
    shard: int,
    rows: int = 0,
) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "bench.queue",
        "--child",
        f"--api={api}",
        f"--url={url}",
        f"--base-dir={base}",
        f"--shards={shards}",
        f"--shard={shard}",
        f"--wait={'true' if wait else 'false'}",
        f"--rows={rows}",
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=_REPO)


def finish(children: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    out = []
    for child in children:
        stdout, _ = child.communicate(timeout=3600)
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@contextmanager
def provider(limit_tokens: int, limit_requests: int, seconds: float = 4.0) -> Iterator[str]:
    from examples import serving

    argv = [f"--enqueued-tokens={limit_tokens}", f"--queued-requests={limit_requests}"]
    argv += [f"--seconds={seconds}"]
    with serving.in_process("bench.queue_provider", argv, "queue provider") as url:
        yield url


def stats(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url.removesuffix("/v1") + "/stats") as r:
        return dict(json.loads(r.read()))


def checkpoints(base: str, shards: int) -> dict[str, Any]:
    """Rows stored (and stored once), failed rows, refused submissions, from the checkpoints."""
    store = open_store(base)
    stored = once = failed = refused = 0
    for s in range(shards):
        checkpoint = Checkpoint(store, name(s, shards))
        rows = checkpoint.load(ID).rows
        stored += rows.height
        failed += rows.height - rows.get_column("_error").null_count()
        files = checkpoint.data_files()
        ids = pl.concat([pl.read_parquet(f).select(ID) for f in files]).get_column(ID)
        once += int(ids.len() == ids.n_unique())
        records = Records(store, checkpoint.files).load()
        refused += sum(1 for r in records if r.stage == "refused")
    return {
        "rows_stored": stored,
        "shards_stored_once": once,
        "rows_failed": failed,
        "refused_recorded": refused,
    }


def way_wait(
    api: str, url: str, base: str, shards: int, args: argparse.Namespace
) -> dict[str, Any]:
    done = finish([start(args, api, url, base, True, shards, s) for s in range(shards)])
    return {
        "runs": len(done),
        "red_runs": sum(d["red"] for d in done),
        "errors": [d["error"] for d in done if d["red"]][:3],
        "wall_s": round(max(d["ended"] for d in done) - min(d["started"] for d in done), 1),
    }


def way_sensor(
    api: str, url: str, base: str, shards: int, args: argparse.Namespace
) -> dict[str, Any]:
    poll = adapter(api, url)
    store = open_store(base)
    runs = dict.fromkeys(range(shards), 0)
    last_end = dict.fromkeys(range(shards), 0.0)
    ended_at: dict[str, float] = {}  # batch id -> when this loop first saw it ended
    todo, red, began = set(range(shards)), 0, time.time()
    ready = set(todo)
    while todo:
        if ready:
            for s in ready:
                runs[s] += 1
            for d in finish([start(args, api, url, base, False, shards, s) for s in ready]):
                red += d["red"]
                last_end[d["shard"]] = d["ended"]
                if d["finished"]:
                    todo.discard(d["shard"])
        ready = set()
        time.sleep(args.tick)
        freed, any_running, room = 0, False, []
        for s in sorted(todo):  # one tick of provider_batches_sensor
            records = Records(store, Checkpoint(store, name(s, shards)).files).load()
            batches = [r.batch_id for r in records if r.open and r.batch_id]
            if not batches:  # its rows wait for room
                room.append(s)
                continue
            running = False
            for b in batches:
                if b in ended_at:
                    continue
                if poll.poll(b).state is State.RUNNING:
                    running = True
                    break
                ended_at[b] = time.time()
            if running:
                any_running = True
                continue
            ready.add(s)
            freed += 1
        # Each shard whose batches ended frees room for one waiting shard, longest waiting
        # first. With no batch running the sensor waits 600 s before trying again; the loop
        # tries at once.
        room.sort(key=lambda s: last_end[s])
        ready.update(room[: freed if freed or any_running else len(room)])
    return {
        "runs": sum(runs.values()),
        "runs_per_shard": sorted(runs.values()),
        "red_runs": red,
        "wall_s": round(time.time() - began, 1),
    }


def way_split(args: argparse.Namespace) -> dict[str, Any]:
    """One shard of 200,000 rows: its submissions against 50,000 requests and 200 MB."""
    with provider(10**12, 10**9) as url, tempfile.TemporaryDirectory() as base:
        child = start(args, "openai", url, base, True, 1, 0, rows=args.split_rows)
        (done,) = finish([child])
        store = open_store(base)
        records = Records(store, Checkpoint(store, name(0, 1)).files).load()
        api = adapter("openai", url)
        sizes = []
        for r in records:
            batch = api.client.batches.retrieve(r.batch_id)
            total = batch.request_counts.total if batch.request_counts else 0
            sizes.append(total)
        rows = Checkpoint(store, name(0, 1)).load(ID).rows
        return {
            "rows": args.split_rows,
            "red": done["red"],
            "rows_stored": rows.height,
            "submissions": len(records),
            "requests_per_submission": sizes,
            "max_requests": max(sizes),
            "server": stats(url),
        }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shards", default="4,16")
    p.add_argument("--apis", default="openai,anthropic")
    p.add_argument("--ways", default="wait,sensor,split")
    p.add_argument("--tick", type=float, default=1.0, help="the sensor loop's interval (s)")
    p.add_argument("--wait-seconds", type=float, default=4.0, help="a batch's time, way wait")
    p.add_argument(
        "--sensor-seconds",
        type=float,
        default=20.0,
        help="a batch's time, way sensor: long beside a run's start, as real batches are",
    )
    p.add_argument("--split-rows", type=int, default=200_000)
    # a shard's run (internal)
    p.add_argument("--child", action="store_true")
    p.add_argument("--api")
    p.add_argument("--url")
    p.add_argument("--base-dir")
    p.add_argument("--shard", type=int)
    p.add_argument("--wait")
    p.add_argument("--rows", type=int, default=0)
    args = p.parse_args()
    if args.child:
        args.shards = int(args.shards)
        shard_main(args)
        return
    print(f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    for way in args.ways.split(","):
        if way == "split":
            print(f"split: {json.dumps(way_split(args))}", flush=True)
            continue
        for api in args.apis.split(","):
            for shards in (int(n) for n in args.shards.split(",")):
                sizes = [tokens_of(s, shards) for s in range(shards)]
                limit_tokens, limit_requests = max(sizes), ROWS_PER_SHARD
                seconds = args.wait_seconds if way == "wait" else args.sensor_seconds
                with (
                    provider(limit_tokens, limit_requests, seconds) as url,
                    tempfile.TemporaryDirectory() as base,
                ):
                    run_way = way_wait if way == "wait" else way_sensor
                    figures = run_way(api, url, base, shards, args)
                    figures |= checkpoints(base, shards)
                    server = stats(url)
                figures |= {
                    "queue_use": round(server["use"], 3) if server["use"] else None,
                    "queue_peak_use": round(server["peak_use"], 3),
                    "server_refusals": server["refused"] + server["refused_429"],
                    "creates": server["creates"],
                    "submitted": server["submitted"],
                    "processed": server["processed"],
                    "limit": server["limit"],
                }
                print(
                    f"{way} {api} {shards} shards x {ROWS_PER_SHARD:,} rows: {json.dumps(figures)}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
