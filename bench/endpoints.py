"""Endpoints that throttle as real ones do: the package beside a plain asyncio loop of the client.

Every scenario calls the local OpenAI-compatible server (``examples/llm_openai/server.py``, in a
process of its own, 50 ms per answer, 429s with ``Retry-After: 0.2`` sent as
``retry-after-ms: 200``) with the real ``openai.AsyncOpenAI`` client, ``max_retries=0``, both
sides in this process, each against a fresh server so both meet the same 429s, in five pairs
of runs whose first side alternates (this shared machine's rates drift by a third from one run
to the next; the limit change: three pairs, the loop first): the ratio reported is the median
pair's, the lowest and highest beside it:

- the loop: 32 asyncio workers sharing one client, one prompt per call; a worker that gets
  ``openai.RateLimitError`` sleeps its retry-after and sends the same prompt again
  (``bench.openai_ceiling.send_all``);
- the package: the same call in an ``async def`` per-row function (a dict in, a dict out: the
  form for one-row calls) run by the engine, ``checkpoint_interval=64``, checkpointing on local
  disk. ``python -m bench.per_row`` compares it with the frame form.

The endpoints: random 429s on 1 %, 5 % and 20 % of requests (3,200 rows, about 5 s at full speed);
a limit of 32 requests in flight (429 beyond it) with the package started at ``max_concurrency=64``
(twice the rows: finding the limit takes the first second or two, which a run of 5 s weighs more
than a job does; both sides' rate from 3 s on is reported beside); that limit changing 32 -> 8 ->
32 at 4 s and 10 s after the first request, the loop sending for 25 s and the package then given as
many rows, reported in 1-second windows with how long after the limit returns the package is back
to 0.8 of the loop (in that window, and over the rest of the run, 5 windows at least); the same
with 5 % of calls also refused at random all along; no 429 at all.

At 50 ms an answer, 32 calls in flight take about one core of this client (the plain loop's own
event loop is the bound), so on a machine of 2 cores these figures weigh the CPU a side spends
as much as how it adapts. Two scenarios answer in 250 ms instead, so that the endpoint is the
bound, as it is with real models (they answer in seconds): the limit of 32 started at 64 (2,400
rows), and the limit change (no target for its time back: 10 s there is 40 answers' time of one
call, not 200).

Figures per side: rows/s, 429s the server answered (its ``/stats``); for the package its
throttle events, throttled seconds and concurrency at the end. The CPU per row of each side and the
load average go to the details: on a busy machine the package's threads get a larger share of the
CPU than the loop's one, which flatters the package.

A smoke run (fewer than 1,000 rows) serves from threads of this process and runs the limit
change 20 times faster: it checks the code, its figures mean nothing.

    python -m bench.remote --only endpoints             # about 25 minutes
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import time
import uuid
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import openai
import polars as pl

from bench import data
from bench.openai_ceiling import Sent, ask, prompts, send_all
from bench.report import Result
from checkpoint_assets.engine import Checkpoint, RunStats, Settings, open_store, prepare, run
from checkpoint_assets.engine.calls.batches import PerRow
from examples.llm_openai.server import Settings as Server
from examples.llm_openai.server import serve, serve_process, stats

WORKERS = 32
LATENCY_MS = 50.0
RETRY_AFTER = 0.2
REFUSED = ("rate_limited", "throttled")  # the server's two kinds of 429
SCHEDULE = (4.0, 10.0, 25.0)  # the limit drops to 8, returns to 32, the run ends (seconds)
BACK = 0.8  # the share of the loop's rows/s that counts as back
HELD = 5  # windows it must last
PAIRS = 5  # runs of each side per scenario (a run's rate moves by a third with the machine)
CHANGE_PAIRS = 3  # of the limit change, 25 s each side
SETTLED = 3.0  # seconds after the first request from which a side is taken as settled
SLOW_MS = 250.0  # answers slow enough that the endpoint, not this client's CPU, is the bound
SLOW_ROWS = 2400  # about 20 s at 32 in flight


@dataclass(frozen=True)
class Endpoint:
    """One scenario: how the server behaves, where the package starts, and the target."""

    key: str
    title: str
    server: Server
    max_concurrency: int = WORKERS
    target: float | None = None  # package rows/s over the loop's
    in_thread: bool = False  # a smoke run: no server process to start

    def serving(self) -> AbstractContextManager[str]:
        """A fresh server, in a process of its own (in a thread of this one when ``in_thread``)."""
        if self.in_thread:
            return serve(**dataclasses.asdict(self.server))
        return serve_process(self.server)


@dataclass
class Side:
    """One side's run: its answers in time, and what the server refused it."""

    rows: int
    seconds: float
    cpu_seconds: float  # of this process: on a busy machine, what wall time cannot say
    sent: Sent
    refused: int = 0
    run_stats: RunStats | None = None

    @property
    def per_second(self) -> float:
        return self.rows / self.seconds

    @property
    def settled_per_second(self) -> float:
        """Rows/s from ``SETTLED`` s after the first request to the last answer: a job of
        millions of rows runs in this state; how soon it gets there is the whole run's rate."""
        since = self.sent.started + SETTLED
        later = [at for at in self.sent.answered if at >= since]
        return len(later) / (later[-1] - since) if len(later) > 1 else math.nan


def _one_row(max_concurrency: int) -> Settings:
    return Settings(
        id_column=data.ID,
        input_columns=(data.TEXT,),
        checkpoint_interval=64,
        batch_size=1,
        max_concurrency=max_concurrency,
        progress_seconds=3600.0,
    )


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="local", max_retries=0)


async def _warm(base_url: str) -> None:
    """One call that neither 429s nor starts the server's schedule: loads the client's code."""
    async with _client(base_url) as client:
        await client.models.list()


def _loop(endpoint: Endpoint, texts: list[str], seconds: float) -> Side:
    async def drive() -> Sent:
        async with _client(base_url) as client:
            return await send_all(client, texts, WORKERS, seconds)

    with endpoint.serving() as base_url:
        asyncio.run(_warm(base_url))
        cpu, started = time.process_time(), time.perf_counter()
        sent = asyncio.run(drive())
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        side = Side(len(sent.answered), seconds, cpu, sent)
        side.refused = sum(stats(base_url)[k] for k in REFUSED)
    return side


def _package(endpoint: Endpoint, texts: list[str], workdir: str) -> Side:
    frame = pl.DataFrame({data.ID: range(len(texts)), data.TEXT: texts})
    settings = _one_row(endpoint.max_concurrency)
    checkpoint = Checkpoint(open_store(workdir), f"endpoint-{uuid.uuid4().hex[:8]}")
    sent = Sent(math.inf)
    with endpoint.serving() as base_url:
        asyncio.run(_warm(base_url))
        client = _client(base_url)  # first used, and bound, on the engine's event loop

        async def classify(row: dict[str, Any]) -> dict[str, Any]:
            sent.started = min(sent.started, time.perf_counter())
            answer = await ask(client, row[data.TEXT])
            sent.answered.append(time.perf_counter())
            if len(sent.answered) == len(texts):  # the last call: close on the engine's loop
                await client.close()
            return {"answer": answer}

        prepared = prepare(frame, settings)
        cpu, started = time.process_time(), time.perf_counter()
        out, run_stats = run(PerRow(classify), prepared, checkpoint, settings, job=data.JOB)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        side = Side(len(texts), seconds, cpu, sent, run_stats=run_stats)
        side.refused = sum(stats(base_url)[k] for k in REFUSED)
    assert out.get_column("_error").null_count() == len(texts), "a row failed"
    return side


def _windows(side: Side, width: float, count: int) -> list[float]:
    """Rows/s of ``side`` in ``count`` windows of ``width`` seconds from its first request."""
    per = [0] * count
    for at in side.sent.answered:
        i = int((at - side.sent.started) / width)
        if i < count:
            per[i] += 1
    return [n / width for n in per]


def _compare(result: Result, endpoint: Endpoint, loop: Side, ours: Side) -> None:
    result.add(f"loop, {WORKERS} workers", loop.per_second, "rows/s")
    result.add(f"package, max_concurrency={endpoint.max_concurrency}", ours.per_second, "rows/s")
    ratio = ours.per_second / loop.per_second
    target: dict[str, Any] = {} if endpoint.target is None else {"limit": endpoint.target}
    result.add("package / loop", ratio, "x", op=">=", **target)
    settled = ours.settled_per_second / loop.settled_per_second
    result.add(f"package / loop from {SETTLED:g} s after the start", settled, "x")
    result.add("429s answered: loop", loop.refused, "")
    result.add("429s answered: package", ours.refused, "")
    assert ours.run_stats is not None
    sides = {"loop": loop, "package": ours}
    result.add("package: throttle events", ours.run_stats.throttle_events, "")
    result.add("package: throttled seconds", ours.run_stats.throttled_seconds, "s")
    result.add("package: concurrency at the end", ours.run_stats.concurrency_final, "")
    result.details |= {
        "rows": loop.rows,
        "seconds": {"loop": loop.seconds, "package": ours.seconds},
        "cpu_ms_per_row": {s: 1000 * x.cpu_seconds / x.rows for s, x in sides.items()},
        "server": endpoint.server.argv(),
    }


def _retry_after_seen(result: Result, loop: Side) -> None:
    """The delay the client read from the 429s: fractional, as the server sent it."""
    if loop.sent.refused:
        if loop.sent.delays != {RETRY_AFTER}:
            raise RuntimeError(f"the client read retry-after {loop.sent.delays}, not {RETRY_AFTER}")
        result.add("retry-after the loop slept", RETRY_AFTER, "s")


def measure(
    endpoint: Endpoint, texts: list[str], workdir: str, seconds: float = math.inf, pairs: int = 1
) -> tuple[Result, Side, Side]:
    """Both sides against ``endpoint``; the figures side by side. The loop stops taking prompts
    after ``seconds``; the package then gets as many as the loop answered.

    ``pairs`` > 1: that many pairs, the side that goes first alternating (a shared machine's
    rate drifts by a third from one run to the next); the ratio is the median of the pairs',
    the other figures those of the median pair."""
    result = Result(endpoint.key, endpoint.title)
    result.details["load_before"] = os.getloadavg()
    runs: list[tuple[float, Side, Side]] = []
    for pair in range(pairs):
        if pair % 2 == 0 or not math.isinf(seconds):  # a timed loop sets the package's rows
            loop = _loop(endpoint, texts, seconds)
            ours = _package(endpoint, texts[: loop.rows], workdir)
        else:
            ours = _package(endpoint, texts, workdir)
            loop = _loop(endpoint, texts, seconds)
        runs.append((ours.per_second / loop.per_second, loop, ours))
    runs.sort(key=lambda run: run[0])
    _, loop, ours = runs[len(runs) // 2]
    result.details["load_after"] = os.getloadavg()
    _compare(result, endpoint, loop, ours)
    if pairs > 1:
        result.add(f"package / loop, lowest of {pairs} pairs", runs[0][0], "x")
        result.add(f"package / loop, highest of {pairs} pairs", runs[-1][0], "x")
        result.details["ratios"] = [run[0] for run in runs]
    _retry_after_seen(result, loop)
    return result, loop, ours


def _rows_for(server: Server, seconds: float, unit: float) -> int:
    """Rows the loop could answer in ``seconds`` at most, at the server's limits."""
    steps = round(seconds / unit)
    limits = (server.limit_at(i * unit) or WORKERS for i in range(steps))
    return sum(round(min(limit, WORKERS) * unit * 1000 / server.latency_ms) for limit in limits)


def _back_after(loop: list[float], ours: list[float], start: int) -> float:
    """Windows from ``start`` to the end of the first window in which the package is at ``BACK``
    of the loop and from which on it did ``BACK`` of the loop's rows, over ``HELD`` windows at
    least (infinite if never). One slow window on a busy machine does not undo a recovery."""
    for i in range(start, len(loop) - HELD + 1):
        if ours[i] >= BACK * loop[i] and sum(ours[i:]) >= BACK * sum(loop[i:]):
            return i + 1 - start
    return math.inf


def limit_change(
    workdir: str,
    unit: float,
    in_thread: bool = False,
    pairs: int = 1,
    latency_ms: float = LATENCY_MS,
    rate_429: float = 0.0,
    target: bool = True,
) -> Result:
    """The limit drops to 8 and returns to 32; rows/s of both sides in windows of ``unit`` s.
    ``rate_429``: the endpoint also refuses that share of calls at random, all along.

    ``pairs`` > 1: that many pairs (the loop first: its answers set the package's rows); the
    figures are those of the pair whose package came back in the median time, the quickest and
    slowest beside them. ``target``: hold the time back to 10 windows at most."""
    drop, back, end = (t * unit for t in SCHEDULE)
    server = Server(
        latency_ms=latency_ms,
        rate_429=rate_429,
        retry_after_seconds=RETRY_AFTER,
        max_in_flight=WORKERS,
        limit_schedule=((drop, 8), (back, WORKERS)),
    )
    title = f"in flight limit 32, 8 from {drop:g} s, 32 from {back:g} s; {unit:g} s windows"
    key = "limit 32>8>32"
    if latency_ms != LATENCY_MS:
        key, title = f"{key}, {latency_ms:g} ms", f"{title}; {latency_ms:g} ms answers"
    if rate_429:
        key, title = f"{key}, {rate_429:.0%} 429", f"{title}; {rate_429:.0%} refused at random"
    endpoint = Endpoint(key, title, server, in_thread=in_thread)
    texts = prompts(_rows_for(server, end, unit))
    returned = round(back / unit)
    runs: list[tuple[float, Result, list[float], list[float]]] = []
    for _ in range(pairs):
        result, loop, ours = measure(endpoint, texts, workdir, seconds=end)
        spans = (s.sent.answered[-1] - s.sent.started for s in (loop, ours))
        count = int(min(spans) / unit)  # whole windows while both sides run
        theirs, mine = (_windows(s, unit, count) for s in (loop, ours))
        runs.append((_back_after(theirs, mine, returned) * unit, result, theirs, mine))
    runs.sort(key=lambda run: run[0])
    since, result, theirs, mine = runs[len(runs) // 2]
    within = {"limit": 10 * unit} if target else {}
    result.add(f"back to >= {BACK} of the loop after the limit returns", since, "s", **within)
    after = list(zip(theirs, mine, strict=True))[returned:]
    result.add(
        f"windows after it at >= {BACK} of the loop, of {len(after)}",
        sum(m >= BACK * t for t, m in after),
        "",
    )
    if pairs > 1:
        result.add(f"back after, quickest of {pairs} pairs", runs[0][0], "s")
        result.add(f"back after, slowest of {pairs} pairs", runs[-1][0], "s")
        result.details["back_after"] = [run[0] for run in runs]
    for i, (loop_rate, rate) in enumerate(zip(theirs, mine, strict=True)):
        limit = server.limit_at(i * unit)
        name = f"{i * unit:g}-{(i + 1) * unit:g} s, limit {limit}: loop {loop_rate:.0f}/s; package"
        result.add(name, rate, "rows/s")
    result.details["windows"] = {"loop": theirs, "package": mine}
    return result


def endpoints(rows: int, workdir: str, smoke: bool = False, pairs: int = PAIRS) -> list[Result]:
    """Every endpoint scenario (``pairs`` of runs each, ``CHANGE_PAIRS`` of the limit change).
    ``smoke``: servers in threads, the limit change 20 times faster, one pair of runs each."""
    base: dict[str, Any] = {"latency_ms": LATENCY_MS, "retry_after_seconds": RETRY_AFTER}

    def random_429(rate: float, target: float | None) -> Endpoint:
        server = Server(rate_429=rate, **base)
        return Endpoint(
            f"random 429 {rate:.0%}", f"{rate:.0%} of requests get 429", server, target=target
        )

    limit_32 = Endpoint(
        "limit 32 from 64",
        "429 beyond 32 in flight; the package starts at 64, the loop has 32 workers; 2x the rows",
        Server(max_in_flight=WORKERS, **base),
        max_concurrency=2 * WORKERS,
        target=0.8,
    )
    no_429 = Endpoint("no 429", "every request answered", Server(**base), target=0.85)
    slow = {**base, "latency_ms": SLOW_MS}
    limit_32_slow = Endpoint(
        f"limit 32 from 64, {SLOW_MS:g} ms",
        f"the same limit, answers in {SLOW_MS:g} ms: the endpoint is the bound, not this client",
        Server(max_in_flight=WORKERS, **slow),
        max_concurrency=2 * WORKERS,
        target=0.8,
    )
    texts = prompts(rows)

    def both(endpoint: Endpoint, texts: list[str] = texts) -> Result:
        ran = dataclasses.replace(endpoint, in_thread=smoke)
        return measure(ran, texts, workdir, pairs=1 if smoke else pairs)[0]

    def change(**server: Any) -> Result:
        unit, change_pairs = (0.05, 1) if smoke else (1.0, CHANGE_PAIRS)
        return limit_change(workdir, unit, in_thread=smoke, pairs=change_pairs, **server)

    return [
        *(both(e) for e in (random_429(0.01, None), random_429(0.05, 0.8), random_429(0.2, 0.7))),
        both(limit_32, prompts(2 * rows)),  # how soon it settles weighs less than in 5 s
        change(),
        change(rate_429=0.05, target=False),
        both(no_429),
        both(limit_32_slow, prompts(rows if smoke else SLOW_ROWS)),
        change(latency_ms=SLOW_MS, target=False),
    ]
