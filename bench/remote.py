"""Throughput of one-row calls to a remote model, checkpointed, beside the same run without.

One row per call, ``max_concurrency=32``, 50 ms per call: the endpoint's limit is 32 / 0.05 s =
640 rows/s. Each scenario runs the engine twice on the same input, with checkpointing on and
off (``checkpointing: false`` keeps results in memory), so a busy machine slows both alike:

- ``sleep``: ``time.sleep(0.05)``, on local disk and on S3 (a moto server in its own process);
- ``async``: ``await asyncio.sleep(0.05)`` in an ``async def``, local disk and S3;
- ``openai``: the real ``openai`` client (``examples.llm_openai``) against the local
  OpenAI-compatible server in its own process, 50 ms per answer; beside it the client ceiling,
  a plain asyncio loop of the same client without Dagster or this package;
- ``throttled``: an in-process endpoint that admits 32 calls at once and answers the rest with
  ``httpx.HTTPStatusError`` 429 and ``Retry-After: 0.2``, the shard started at
  ``max_concurrency=64``: adaptive concurrency has to settle near 32;
- ``kill``: a child process running one-row calls with ``checkpoint_interval=64`` and 32 in flight
  is SIGKILLed mid-run, then run again; rows computed twice against the documented bound;
- ``endpoints`` (``bench/endpoints.py``): the server answering 429 as real endpoints do (random
  429s on 1, 5 and 20 % of requests; a limit of 32 in flight, the shard started at 64; that limit
  changing 32 -> 8 -> 32 mid-run; no 429), the package beside a plain asyncio loop of the same
  client that sleeps each 429's retry-after, in the same process.

    python -m bench.run --only remote                   # about four minutes
    python -m bench.remote --rows 3200                  # the same, on its own
    python -m bench.remote --only endpoints             # the 429 endpoints only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``examples`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import polars as pl

from bench import data, endpoints
from bench.report import Result
from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run

CONCURRENCY = 32
LATENCY = 0.05
LIMIT = CONCURRENCY / LATENCY  # rows per second the endpoint allows
INTERVAL = 64


def _settings(**kw: Any) -> Settings:
    base: dict[str, Any] = {
        "id_column": data.ID,
        "input_columns": (data.TEXT,),
        "checkpoint_interval": INTERVAL,
        "batch_size": 1,
        "max_concurrency": CONCURRENCY,
        "retry_delay_seconds": 0.0,
        "progress_seconds": 3600.0,
    }
    return Settings(**(base | kw))


def _rate(fn: Any, frame: pl.DataFrame, base_dir: str, options: dict[str, Any], **kw: Any) -> float:
    """Rows per second of one run (checkpointed unless ``checkpointing=False``)."""
    s = _settings(**kw)
    checkpoint = Checkpoint(open_store(base_dir, options), f"run-{uuid.uuid4().hex[:8]}")
    prepared = prepare(frame, s)
    started = time.perf_counter()
    result, _ = run(fn, prepared, checkpoint, s, job=data.JOB)
    seconds = time.perf_counter() - started
    assert result.get_column("_error").null_count() == frame.height
    return frame.height / seconds


def _sleep_fn(batch: pl.DataFrame) -> pl.DataFrame:
    time.sleep(LATENCY)
    return data.score(batch)


async def _async_fn(batch: pl.DataFrame) -> pl.DataFrame:
    await asyncio.sleep(LATENCY)
    return data.score(batch)


# -- S3 on a moto server of its own ---------------------------------------------------------
@contextlib.contextmanager
def moto_process() -> Iterator[tuple[str, dict[str, Any]]]:
    """A moto S3 server in its own process; yields (base_dir, storage_options) in a new bucket."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(endpoint, timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.1)
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        ).create_bucket(Bucket="bench")
        options = {
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            # moto on a busy machine may answer a part, or a CompleteMultipartUpload (it copies
            # every part into one buffer), after botocore's 60 s; a request sent again while the
            # first is still served races moto's multipart code (a part closed under the
            # complete: HTTP 500 on every retry).
            "config_kwargs": {"read_timeout": 600},
        }
        yield "s3://bench/checkpoints", options
    finally:
        server.terminate()
        server.wait(timeout=15)


def _pair(
    result: Result, name: str, fn: Any, frame: pl.DataFrame, storage: tuple[str, dict[str, Any]]
) -> None:
    base_dir, options = storage
    plain = _rate(fn, frame, base_dir, options, checkpointing=False)
    ours = _rate(fn, frame, base_dir, options)
    result.add(f"{name}: without checkpointing", plain / LIMIT, "of limit")
    result.add(f"{name}: checkpointed", ours / LIMIT, "of limit", limit=0.9, op=">=")
    result.add(f"{name}: checkpointed / without", ours / plain, "x")
    result.details[name] = {"rows_per_second": ours, "without": plain}


def throughput(rows: int, workdir: str) -> Result:
    """``time.sleep`` and ``asyncio.sleep`` functions, local disk and S3."""
    result = Result("remote", f"one-row calls, {CONCURRENCY} in flight, 50 ms: share of 640/s")
    frame = data.make_input(rows)
    local = (os.path.join(workdir, "remote"), {})
    _pair(result, "sleep, local", _sleep_fn, frame, local)
    _pair(result, "async, local", _async_fn, frame, local)
    with moto_process() as s3:
        _pair(result, "sleep, S3", _sleep_fn, frame, s3)
        _pair(result, "async, S3", _async_fn, frame, s3)
    result.details["rows"] = rows
    return result


# -- the real openai client -------------------------------------------------------------------
def openai_client(rows: int, workdir: str, repeat: int = 3) -> Result:
    """The openai client through a checkpointed function vs the same without checkpointing."""
    from bench.openai_ceiling import measure, prompts
    from checkpoint_assets import OpenAIResource
    from examples.llm_openai.definitions import SYSTEM
    from examples.llm_openai.server import Settings as ServerSettings
    from examples.llm_openai.server import serve_process

    result = Result("openai", "the openai client, checkpointed vs not, and the client ceiling")
    texts = prompts(rows)
    frame = pl.DataFrame({data.ID: range(rows), data.TEXT: texts})
    local = os.path.join(workdir, "openai")
    with serve_process(ServerSettings(latency_ms=LATENCY * 1000)) as base_url:
        chat = OpenAIResource(base_url=base_url, api_key="local", model="m")

        async def classify(batch: pl.DataFrame) -> pl.DataFrame:
            (text,) = batch.get_column(data.TEXT).to_list()
            reply = await chat.client().chat.completions.create(
                model=chat.model,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
            )
            return batch.select(data.ID, answer=pl.lit(reply.choices[0].message.content))

        ceiling, plain, ours = [], [], []
        for _ in range(repeat):
            ceiling.append(measure(base_url, texts, CONCURRENCY).per_second)
            plain.append(_rate(classify, frame, local, {}, checkpointing=False))
            ours.append(_rate(classify, frame, local, {}))
    med = sorted
    c, p, o = (
        med(ceiling)[len(ceiling) // 2],
        med(plain)[len(plain) // 2],
        med(ours)[len(ours) // 2],
    )
    result.add("client ceiling (plain asyncio loop)", c, "rows/s")
    result.add("without checkpointing", p, "rows/s")
    result.add("checkpointed", o, "rows/s")
    result.add("checkpointed / without", o / p, "x", limit=0.95, op=">=")
    result.add("checkpointed / ceiling", o / c, "x")
    result.details = {"rows": rows, "ceiling": ceiling, "without": plain, "checkpointed": ours}
    return result


# -- throttling ---------------------------------------------------------------------------------
class AdmittingEndpoint:
    """Admits ``admit`` calls at once; the others get HTTP 429 with ``Retry-After``."""

    def __init__(self, admit: int, retry_after: float) -> None:
        self.admit = admit
        self.retry_after = retry_after
        self.in_flight = 0
        self.rejected = 0
        self.peak = 0
        self.lock = threading.Lock()
        self.request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")

    def __call__(self, batch: pl.DataFrame) -> pl.DataFrame:
        with self.lock:
            if self.in_flight >= self.admit:
                self.rejected += 1
                headers = {"Retry-After": str(self.retry_after)}
                response = httpx.Response(429, headers=headers, request=self.request)
                raise httpx.HTTPStatusError("429", request=self.request, response=response)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            time.sleep(LATENCY)
            return data.score(batch)
        finally:
            with self.lock:
                self.in_flight -= 1


def throttled(rows: int, workdir: str) -> Result:
    result = Result("throttled", "admits 32 at once, 429 + Retry-After 0.2 s, started at 64")
    frame = data.make_input(rows)
    endpoint = AdmittingEndpoint(CONCURRENCY, 0.2)
    s = _settings(max_concurrency=2 * CONCURRENCY)
    checkpoint = Checkpoint(open_store(os.path.join(workdir, "throttled")), "throttled")
    started = time.perf_counter()
    out, stats = run(endpoint, prepare(frame, s), checkpoint, s, job=data.JOB)
    seconds = time.perf_counter() - started
    assert out.get_column("_error").null_count() == rows
    result.add("rows per second / limit", rows / seconds / LIMIT, "of limit", limit=0.8, op=">=")
    result.add("throttle events", stats.throttle_events, "")
    result.add("429 answers", endpoint.rejected, "")
    result.add("throttled seconds", stats.throttled_seconds, "s")
    result.add("concurrency at the end", stats.concurrency_final, "")
    result.details = {"rows": rows, "seconds": seconds, "peak_admitted": endpoint.peak}
    return result


# -- a SIGKILL in the middle ----------------------------------------------------------------
def _child(spec: dict[str, Any]) -> None:
    """The killed process: the sleep function, logging each id it computed."""
    fd = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        out = _sleep_fn(batch)
        os.write(fd, "".join(f"{i}\n" for i in batch.get_column(data.ID).to_list()).encode())
        return out

    s = _settings(min_flush_seconds=spec["min_flush_seconds"])
    checkpoint = Checkpoint(open_store(spec["base_dir"], spec["options"]), "killed")
    run(fn, prepare(data.make_input(spec["rows"]), s), checkpoint, s, job=data.JOB)


def _computed(log: str) -> list[int]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [int(line) for line in f if line.strip()]


def kill(rows: int, workdir: str, with_s3: bool = True) -> Result:
    result = Result("kill", "SIGKILL mid-run: rows computed twice vs the documented bound")
    bound = _settings(min_flush_seconds=0.0).loss_bound().rows  # as the child runs
    places = [("local", (os.path.join(workdir, "killed"), {})), ("S3", None)]
    for name, storage in places if with_s3 else places[:1]:
        with contextlib.ExitStack() as stack:
            base_dir, options = storage or stack.enter_context(moto_process())
            log = os.path.join(workdir, f"killed-{name}.log")
            spec = {"rows": rows, "base_dir": base_dir, "options": options, "log": log}
            spec["min_flush_seconds"] = 0.0
            argv = [sys.executable, "-m", "bench.remote", "--child", json.dumps(spec)]
            cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            child = subprocess.Popen(argv, cwd=cwd)
            while len(_computed(log)) < rows // 2:
                assert child.poll() is None, "the child ended before the kill"
                time.sleep(0.01)
            child.send_signal(signal.SIGKILL)
            child.wait()
            subprocess.run(argv, cwd=cwd, check=True)
            computed = _computed(log)
            twice = len(computed) - len(set(computed))
            stored = Checkpoint(open_store(base_dir, options), "killed").read_merged()[0]
            assert stored is not None and stored.height == rows
            assert stored.get_column(data.ID).n_unique() == rows, "a row is stored twice"
            result.add(f"{name}: rows computed twice", twice, "rows", limit=bound)
    result.details = {"rows": rows, "bound": bound}
    return result


def all_scenarios(rows: int, workdir: str) -> list[Result]:
    """Every scenario; a smoke run (a few hundred rows) repeats nothing and kills locally only."""
    full = rows >= 1000
    return [
        throughput(rows, workdir),
        openai_client(rows, workdir, repeat=3 if full else 1),
        throttled(rows, workdir),
        kill(rows, workdir, with_s3=full),
        *endpoints.endpoints(rows, workdir, smoke=not full),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=3200, help="rows per run (3200: 5 s at the limit)")
    p.add_argument("--only", help="throughput, openai, throttled, kill, endpoints (default: all)")
    p.add_argument("--pairs", type=int, default=endpoints.PAIRS, help="runs a side, endpoints")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    from bench.report import table

    runs: dict[str, Callable[[int, str], list[Result]]] = {
        "throughput": lambda rows, workdir: [throughput(rows, workdir)],
        "openai": lambda rows, workdir: [openai_client(rows, workdir)],
        "throttled": lambda rows, workdir: [throttled(rows, workdir)],
        "kill": lambda rows, workdir: [kill(rows, workdir)],
        "endpoints": lambda rows, workdir: endpoints.endpoints(
            rows, workdir, smoke=rows < 1000, pairs=args.pairs
        ),
    }
    chosen = args.only.split(",") if args.only else list(runs)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as workdir:
        print(table([result for name in chosen for result in runs[name](args.rows, workdir)]))
    after = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nload average {load} before, {after} after, on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
