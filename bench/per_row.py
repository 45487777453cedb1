"""CPU per row of one-row calls to a remote model: a plain asyncio loop vs the package.

The real ``openai`` client (``AsyncOpenAI``) against the local OpenAI-compatible server in its
own process (50 ms per answer), 32 calls in flight, one row per call. Three ways to send the
same prompts, in turns, ``--repeat`` times:

- ``plain``: a plain asyncio loop of the same client, 32 workers (bench/openai_ceiling.py);
- ``frame``: the package, checkpointed (``checkpoint_interval=64``), an ``async def`` function
  of a one-row ``pl.DataFrame`` returning a frame;
- ``row``: the same with a per-row function (a dict in, a dict out).

The client is CPU-bound when it shares a small machine with the server, so the figure that
survives a busy machine is the process's CPU time per row (all threads: the event loop, the
run loop, the writer, polars' pool); wall rows/s are printed beside it, comparable only when
the machine is quiet. The package's overhead is its CPU per row minus the plain loop's.

    python -m bench.per_row                       # 3200 rows, 5 turns
    python -m bench.per_row --rows 1600 --repeat 9 --only plain,row
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``examples`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import openai
import polars as pl

from bench.openai_ceiling import SYSTEM, measure, prompts
from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from examples.llm_openai.server import Settings as ServerSettings
from examples.llm_openai.server import serve_process

CONCURRENCY = 32
LATENCY_MS = 50.0
ID, TEXT = "id", "text"


class Client:
    """One ``AsyncOpenAI`` client per event loop (each run of the package has its own loop)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self._clients: dict[asyncio.AbstractEventLoop, openai.AsyncOpenAI] = {}

    async def answer(self, text: str) -> str:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = openai.AsyncOpenAI(base_url=self.base_url, api_key="local", max_retries=0)
            self._clients[loop] = client
        reply = await client.chat.completions.create(
            model="ticket-router-1",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        )
        return reply.choices[0].message.content or ""


def functions(client: Client) -> dict[str, Any]:
    """The package's two forms of the same function."""

    async def classify(batch: pl.DataFrame) -> pl.DataFrame:
        (text,) = batch.get_column(TEXT).to_list()
        return batch.select(ID, answer=pl.lit(await client.answer(text)))

    async def classify_row(row: dict[str, Any]) -> dict[str, Any]:
        return {"answer": await client.answer(row[TEXT])}

    forms: dict[str, Any] = {"frame": classify}
    try:  # absent from versions before the per-row form: measure the frame form alone
        from checkpoint_assets.engine.calls.batches import PerRow

        forms["row"] = PerRow(classify_row)
    except ImportError:
        pass
    return forms


def package(fn: Any, frame: pl.DataFrame, base_dir: str) -> tuple[float, float]:
    """CPU seconds and wall seconds of one checkpointed run."""
    s = Settings(
        id_column=ID,
        input_columns=(TEXT,),
        checkpoint_interval=64,
        batch_size=1,
        max_concurrency=CONCURRENCY,
        retry_delay_seconds=0.0,
        progress_seconds=3600.0,
    )
    checkpoint = Checkpoint(open_store(base_dir), f"run-{uuid.uuid4().hex[:8]}")
    prepared = prepare(frame, s)
    cpu, wall = time.process_time(), time.perf_counter()
    result, _ = run(fn, prepared, checkpoint, s, job={"bench": "per_row"})
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert result.get_column("_error").null_count() == frame.height, "a call failed"
    return cpu, wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=3200, help="rows per run (3200)")
    p.add_argument("--repeat", type=int, default=5, help="turns of every way; medians printed")
    p.add_argument("--only", help="plain, frame, row (default: all)")
    args = p.parse_args(argv)
    texts = prompts(args.rows)
    frame = pl.DataFrame({ID: range(args.rows), TEXT: texts})
    cpu: dict[str, list[float]] = {}
    rate: dict[str, list[float]] = {}
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{args.rows} rows, {CONCURRENCY} in flight, {LATENCY_MS:g} ms; load average {load}")
    with (
        serve_process(ServerSettings(latency_ms=LATENCY_MS)) as base_url,
        tempfile.TemporaryDirectory(prefix="bench-per-row-") as workdir,
    ):
        ways: dict[str, Callable[[], tuple[float, float]]] = {}
        for name, fn in functions(Client(base_url)).items():
            ways[name] = lambda fn=fn: package(fn, frame, workdir)

        def plain() -> tuple[float, float]:
            c = measure(base_url, texts, CONCURRENCY)
            return c.client_cpu_seconds, c.seconds

        ways = {"plain": plain, **ways}
        chosen = args.only.split(",") if args.only else list(ways)
        for _ in range(args.repeat):
            for name in chosen:
                seconds, wall = ways[name]()
                cpu.setdefault(name, []).append(seconds / args.rows * 1e6)
                rate.setdefault(name, []).append(args.rows / wall)
    base = statistics.median(cpu["plain"]) if "plain" in cpu else None
    for name in chosen:
        us = statistics.median(cpu[name])
        vs = f"; CPU of the plain loop / this: {base / us:.2f}" if base else ""
        runs = ", ".join(f"{r:.0f}" for r in rate[name])
        print(f"{name:6} {us:6.0f} µs CPU per row (median){vs}; rows/s: {runs}")
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
