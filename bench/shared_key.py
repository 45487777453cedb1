"""Shards that share one key: how much of the key's budget they use, and how often they are refused.

Each scenario starts the local chat server in its own process, enforcing a key's budget the way
OpenAI does (a bucket refilled steadily over a 2-second window, ``429`` for what does not fit),
then ``--shards`` shards of the OpenAI example's asset at once, each a ``dagster asset
materialize`` process of its own, as a backfill runs them (``bench/shared_key_defs.py``: one
ticket per call, 32 in flight per shard). Their first calls wait until all are ready, so the
shards start together however long their processes take to start on a busy machine.

- ``tokens``: a tokens budget, stated in OpenAI's ``x-ratelimit-*`` headers;
- ``requests``: a requests budget, stated the same way;
- ``no_headers``: the tokens budget enforced but never stated, with ``tokens_per_minute`` set
  on the resource (the shards count each other).

The budget is the baseline: use is what the server charged over what the budget allowed from
its first charge to its last (a full bucket, then its refill). Refusals per answer are the
server's ``429`` over its answers.

Shards end apart, so the run's tail has fewer shards calling. Beside the issue's figure, the
bench samples the server's charges every ``SAMPLE_SECONDS``. "Rate while all ran" is what it
charged per second from its first charge until the first shard's process ended (or its last
charge, if earlier), over the key's rate. The full bucket drawn at the start is in it, so it may
pass 1. "Seconds after the first ended" is how long the last process ran after that. A process
ends seconds after its last call, once Dagster has stored its run.

    python -m bench.shared_key                        # 4 and 16 shards, every scenario
    python -m bench.shared_key --shards 4 --only tokens --tickets 1200
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``examples`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import Result, table
from examples.llm_openai.server import Settings, serve_process, stats

REPO = Path(__file__).resolve().parents[1]
DEFS = "bench.shared_key_defs"
WINDOW_SECONDS = 2.0
SCENARIOS = ("tokens", "requests", "no_headers")
SAMPLE_SECONDS = 0.25  # how often the server's charges are sampled while the shards run


def server_settings(scenario: str, tokens_per_second: int, requests_per_second: int) -> Settings:
    """The server of a scenario: 20 ms answers and the key's one budget."""
    if scenario == "requests":
        return Settings(
            latency_ms=20,
            requests_per_minute=requests_per_second * 60,
            budget_window_seconds=WINDOW_SECONDS,
        )
    return Settings(
        latency_ms=20,
        tokens_per_minute=tokens_per_second * 60,
        budget_window_seconds=WINDOW_SECONDS,
        limit_headers=scenario != "no_headers",
    )


def materialize(
    env: dict[str, str], *args: str, log: IO[str] | None = None
) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "dagster", "asset", "materialize", "-m", DEFS, *args]
    out = log if log is not None else subprocess.PIPE
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True
    )


def watch(
    processes: list[subprocess.Popen[str]], base_url: str, charged: str
) -> tuple[list[tuple[float, int]], list[float]]:
    """Wait for ``processes``, sampling what the server ``charged`` every ``SAMPLE_SECONDS``.
    Returns the samples (time, charged so far) and when each process ended."""
    samples: list[tuple[float, int]] = []
    ended = [math.inf] * len(processes)
    while True:
        now = time.perf_counter()
        samples.append((now, stats(base_url)[charged]))
        for i, process in enumerate(processes):
            if ended[i] == math.inf and process.poll() is not None:
                ended[i] = now
        if all(e < math.inf for e in ended):
            return samples, ended
        time.sleep(SAMPLE_SECONDS)


def while_all_run(samples: list[tuple[float, int]], ended: list[float]) -> tuple[float, float]:
    """What the server charged per second while every shard's process ran (from the first
    sample with a charge to the first process that ended, or the last charge if earlier), and
    those seconds."""
    first = next((t, c) for t, c in samples if c > 0)
    final = next(t for t, c in samples if c == samples[-1][1])  # the last charge, sampled
    last = max((s for s in samples if s[0] <= min(min(ended), final)), default=first)
    seconds = last[0] - first[0]
    return ((last[1] - first[1]) / seconds if seconds > 0 else math.nan), seconds


def run(scenario: str, shards: int, tickets: int, tps: int, rps: int) -> Result:
    """One scenario with ``shards`` at once; its figures."""
    result = Result(f"{scenario}/{shards}", f"{shards} shards, {scenario}")
    settings = server_settings(scenario, tps, rps)
    with (
        tempfile.TemporaryDirectory(prefix="bench-shared-key-") as workdir,
        serve_process(settings) as base_url,
    ):
        home = Path(workdir, "dagster_home")
        home.mkdir()
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        env = dict(os.environ)
        env.update(
            DAGSTER_HOME=str(home),
            CHECKPOINT_BASE_DIR=str(Path(workdir, "checkpoints")),
            OPENAI_BASE_URL=base_url,
            SHARED_KEY_SHARDS=str(shards),
            SHARED_KEY_TICKETS=str(tickets),
            SHARED_KEY_READY_DIR=str(Path(workdir, "ready")),
        )
        Path(workdir, "ready").mkdir()
        if scenario == "no_headers":
            env["SHARED_KEY_TOKENS_PER_MINUTE"] = str(tps * 60)
        source = materialize(env, "--select", "shared_key_tickets")
        output = source.communicate()[0]
        if source.returncode != 0:
            raise RuntimeError(f"the source failed:\n{output[-3000:]}")
        width = len(str(shards - 1))
        keys = [f"{i:0{width}d}-of-{shards}" for i in range(shards)]
        charged = "budget_requests" if scenario == "requests" else "budget_tokens"
        with contextlib.ExitStack() as stack:
            logs = [stack.enter_context(Path(workdir, f"{k}.log").open("w")) for k in keys]
            started = time.perf_counter()
            processes = [
                materialize(env, "--select", "shared_key_department", "--partition", key, log=log)
                for key, log in zip(keys, logs, strict=True)
            ]
            samples, ended = watch(processes, base_url, charged)
            wall = time.perf_counter() - started
            served = stats(base_url)
        outputs = [Path(log.name).read_text() for log in logs]
    failed = [k for k, p in zip(keys, processes, strict=True) if p.returncode != 0]
    if failed:
        last = outputs[keys.index(failed[0])]
        raise RuntimeError(f"shards {failed} failed; the first said:\n{last[-3000:]}")
    seconds = served["budget_ms"] / 1000
    per_second = rps if scenario == "requests" else tps
    allowed = per_second * (WINDOW_SECONDS + seconds)
    answered = served["ok"]
    result.add("budget used", served[charged] / allowed, limit=0.9, op=">=")
    result.add("refusals per answer", served["over_budget"] / answered, limit=0.02)
    rate, together = while_all_run(samples, ended)
    result.add("rate while all ran", rate / per_second)
    result.add("seconds all ran", together, "s")
    result.add("seconds after the first ended", max(ended) - min(ended), "s")
    result.add("answers", answered)
    result.add("refusals", served["over_budget"])
    result.add("seconds charged", seconds, "s")
    result.add("wall", wall, "s")
    result.add("load average (1 min)", os.getloadavg()[0])
    result.details = {"served": served, "server": settings.argv()}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shards", default="4,16", help="shards at once, comma-separated (4,16)")
    p.add_argument("--only", help=f"scenarios, comma-separated (default: {','.join(SCENARIOS)})")
    p.add_argument("--tickets", type=int, default=2400, help="rows over all shards (2400)")
    p.add_argument("--tokens-per-second", type=int, default=3000, help="the key's (3000)")
    p.add_argument("--requests-per-second", type=int, default=36, help="the key's (36)")
    args = p.parse_args(argv)
    scenarios = args.only.split(",") if args.only else list(SCENARIOS)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{args.tickets} tickets; load average {load}", flush=True)
    results = []
    for shards in (int(s) for s in args.shards.split(",")):
        for scenario in scenarios:
            result = run(
                scenario, shards, args.tickets, args.tokens_per_second, args.requests_per_second
            )
            print(table([result]), flush=True)
            results.append(result)
    print(table(results))
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
