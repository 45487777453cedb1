"""The client ceiling: chat completions per second a plain asyncio loop reaches, without Dagster.

``concurrency`` coroutines share one ``openai.AsyncOpenAI`` client and send one prompt per call
(the demo's tickets) to the local OpenAI-compatible server, which answers after
``latency_ms``. With 32 in flight and 50 ms the ideal is 640 requests/s; what is missing is the
client's own CPU work (building, sending and parsing each request). A checkpointed asset calling
the same endpoint can at best reach this figure, so it is the yardstick of its overhead.

``send_all`` is that loop; on a ``429`` a coroutine sleeps the retry-after it carries and sends
the same prompt again, which makes it the baseline of ``bench.endpoints`` too.

The server runs in a separate process by default: in a thread of the measuring process it
competes with the client for the same interpreter lock. ``--server thread`` measures that too.

    python -m bench.openai_ceiling                        # 3000 requests, 32 in flight, 50 ms
    python -m bench.openai_ceiling --server both --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import statistics
import sys
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``examples`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import openai

from examples.llm_openai.server import Settings, serve, serve_process, stats
from examples.ticket_routing.data import generate_tickets

SYSTEM = "Route the support ticket to one department. Answer with the department only."


@dataclass(frozen=True)
class Ceiling:
    """One measurement: ``requests`` answered in ``seconds`` of wall time, and the CPU spent.

    On a busy machine the wall-time rate drops with the CPU share the client gets; the CPU per
    request hardly does, so it is the figure to compare across runs and machines.
    """

    requests: int
    concurrency: int
    seconds: float
    client_cpu_seconds: float  # of this whole process (with the server, in thread mode)
    server_cpu_seconds: float  # of the server's process (this one, in thread mode)
    peak_in_flight: int  # the most requests the server saw at once

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds


def prompts(n: int) -> list[str]:
    """``n`` ticket texts (subject and body) from the demo's generator."""
    tickets = generate_tickets(n)
    return [f"{s}\n\n{b}" for s, b in zip(tickets["subject"], tickets["body"], strict=True)]


@dataclass
class Sent:
    """What :func:`send_all` did: when each answer arrived, and the 429s on the way."""

    started: float  # time.perf_counter() as the first request went out
    answered: list[float] = field(default_factory=list)  # perf_counter() of each answer
    refused: int = 0  # 429 answers, each slept off and the same prompt sent again
    delays: set[float] = field(default_factory=set)  # the retry-after values they carried


def retry_after(error: openai.RateLimitError) -> float:
    """Seconds a 429 asks to wait: ``retry-after-ms``, else ``Retry-After`` (seconds)."""
    headers = error.response.headers
    ms = headers.get("retry-after-ms")
    return float(ms) / 1000 if ms is not None else float(headers.get("retry-after", 1))


async def ask(client: openai.AsyncOpenAI, text: str) -> str:
    """One chat completion for one ticket; its answer."""
    reply = await client.chat.completions.create(
        model="ticket-router-1",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
    )
    answer = reply.choices[0].message.content
    assert answer
    return answer


async def send_all(
    client: openai.AsyncOpenAI, texts: list[str], concurrency: int, seconds: float = math.inf
) -> Sent:
    """``concurrency`` workers send each text once; on a 429 a worker sleeps the retry-after it
    carries and sends the same prompt again: the plain loop a user would write. No new prompt
    is taken ``seconds`` after the first request."""
    pending = iter(texts)
    sent = Sent(time.perf_counter())
    until = sent.started + seconds

    async def worker() -> None:
        for text in pending:  # one shared iterator: each prompt is sent once
            if time.perf_counter() > until:
                return
            while True:
                try:
                    await ask(client, text)
                    break
                except openai.RateLimitError as e:
                    delay = retry_after(e)
                    sent.refused += 1
                    sent.delays.add(delay)
                    await asyncio.sleep(delay)
            sent.answered.append(time.perf_counter())

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sent


async def _drive(base_url: str, texts: list[str], concurrency: int) -> Ceiling:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="local", max_retries=0)
    async with client:
        warmup = iter(texts[:concurrency])  # open the connections before timing
        await asyncio.gather(*(_one(client, t) for t in warmup))
        cpu, start = time.process_time(), time.perf_counter()
        await send_all(client, texts, concurrency)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Ceiling(len(texts), concurrency, seconds, cpu, server_cpu_seconds=0.0, peak_in_flight=0)


async def _one(client: openai.AsyncOpenAI, text: str) -> None:
    await client.chat.completions.create(
        model="ticket-router-1", messages=[{"role": "user", "content": text}]
    )


def measure(base_url: str, texts: list[str], concurrency: int = 32) -> Ceiling:
    """Send every text once, ``concurrency`` at a time, on a fresh asyncio loop; time it.

    Raises if the server answered anything but successes (the measurement would be wrong).
    """
    before = stats(base_url)
    result = asyncio.run(_drive(base_url, texts, concurrency))
    after = stats(base_url)
    failed = (after["requests"] - before["requests"]) - (after["ok"] - before["ok"])
    if failed:
        raise RuntimeError(f"the server refused or failed {failed} requests: {after}")
    # Includes the warm-up requests, a few percent of the total.
    server_cpu = (after["cpu_ms"] - before["cpu_ms"]) / 1000
    return dataclasses.replace(
        result, server_cpu_seconds=server_cpu, peak_in_flight=after["peak_in_flight"]
    )


def _server(kind: str, latency_ms: float) -> AbstractContextManager[str]:
    if kind == "process":
        return serve_process(Settings(latency_ms=latency_ms))
    return serve(latency_ms=latency_ms)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=3000, help="requests timed per repetition")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (32)")
    p.add_argument("--latency-ms", type=float, default=50.0, help="server latency (50)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions; the median is printed")
    p.add_argument(
        "--server",
        choices=("process", "thread", "both"),
        default="process",
        help="run the server as a separate process (default) or in a thread of this one",
    )
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.repeat < 1:
        p.error("--requests, --concurrency and --repeat must be at least 1")
    texts = prompts(args.requests)
    kinds = ("process", "thread") if args.server == "both" else (args.server,)
    ideal = args.concurrency / (args.latency_ms / 1000) if args.latency_ms else float("inf")
    print(
        f"{args.requests} requests, {args.concurrency} in flight, {args.latency_ms:g} ms latency "
        f"(ideal {ideal:.0f} req/s); load average {_load()} on {os.cpu_count()} CPUs"
    )
    for kind in kinds:
        runs: list[Ceiling] = []
        with _server(kind, args.latency_ms) as base_url:
            for _ in range(args.repeat):
                runs.append(measure(base_url, texts, args.concurrency))
        rates = sorted(r.per_second for r in runs)
        client_us = statistics.median(r.client_cpu_seconds / r.requests * 1e6 for r in runs)
        server_us = statistics.median(r.server_cpu_seconds / r.requests * 1e6 for r in runs)
        print(
            f"server in a {kind:7}: median {statistics.median(rates):4.0f} req/s "
            f"(runs: {', '.join(f'{r:.0f}' for r in rates)}); CPU per request: "
            f"{client_us:.0f} µs client process, {server_us:.0f} µs server process; "
            f"peak {max(r.peak_in_flight for r in runs)} in flight; "
            f"with a whole core the client would do {min(1e6 / client_us, ideal):.0f} req/s"
        )
    print(f"load average {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
