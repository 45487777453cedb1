"""A Ray backfill whose run worker is SIGKILLed mid-shard: ids stored, calls paid, the orphan step.

    python -m bench.ray_kill                       # 2000 tickets, 4 shards, 4 calls in flight
    python -m bench.ray_kill --latency-ms 100 --timeout 1200

Real processes on 127.0.0.1, as tests/e2e/test_ray_postgres.py starts them: PostgreSQL, moto's
S3 (checkpoints, compute logs), a 2-CPU Ray head in a temp dir, `dagster dev` with
deploy/ray/dagster.yaml (run monitoring, run retries), and the local chat server of
examples/llm_openai, which counts the calls it answers (``/stats``). The code location is
examples/llm_openai/definitions.py as it is (``ticket_department``: one prompt per call, 4 shards),
shipped to the Ray jobs through the launcher's runtime_env. Its source is materialized first;
then one UI backfill (GraphQL) of the 4 shards, one run (one Ray job) per shard.

Once a shard's run has flushed a part and not finished, its run worker (the `dagster api
execute_run` of that run, found by the run id on its command line) is SIGKILLed. Its step
processes (its descendants just before the kill) should stop by themselves (``run_watch.py``),
run monitoring should fail the run and a run retry resume the shard. When the backfill is done,
the shards' final tables are read back from S3 and one JSON line is printed: rows, ids stored
(once each or not), calls the server counted, calls minus rows, the asset's loss bound
(``Settings.loss_bound`` with the S3 minimum time between flushes at the most rows per second
the settings allow), how long the killed run's step processes outlived the kill, the killed
run's status and the retry's lock messages. The whole is bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
for folder in ("tests", "tests/e2e"):
    sys.path.insert(0, str(ROOT / folder))
from deploy_services import dagster_dev, postgres_server, ray_head  # noqa: E402
from helpers.graphql import launch_backfill  # noqa: E402

from bench.ray_runs import s3_env  # noqa: E402

MODULE = "examples.llm_openai.definitions"
ASSET = "ticket_department"
SHARDS = [f"{i}-of-4" for i in range(4)]  # shard_partitions(4) of the example
PREFIX = f"checkpoints/{ASSET}/default/"
STORE_MIN_FLUSH_SECONDS = 5.0  # the minimum time between flushes on object stores
MAX_RETRIES = 2  # run_retries.max_retries in deploy/ray/dagster.yaml


class Timeout(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise Timeout("the bench ran out of time (--timeout)")


def _s3(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
    )


def _keys(s3: Any, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket="logs", Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _run_worker(run_id: str) -> psutil.Process | None:
    """The `dagster api execute_run` process of ``run_id`` (not the shell Ray starts it in)."""
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = p.info["cmdline"] or []
            text = " ".join(cmd)
            if "execute_run" in cmd and run_id in text and not cmd[0].endswith("sh"):
                return p
    return None


@contextlib.contextmanager
def services(
    work: Path, tickets: int, latency_ms: float, concurrency: int
) -> Iterator[tuple[int, str, str]]:
    """Yields the webserver's port, the chat server's base URL and moto's endpoint."""
    from moto.server import ThreadedMotoServer

    from examples.llm_openai.server import Settings as ServerSettings
    from examples.llm_openai.server import serve_process

    (work / "workspace.yaml").write_text(
        f"load_from:\n  - python_module:\n      module_name: {MODULE}\n"
        f"      working_directory: {ROOT}\n"
    )
    config = yaml.safe_load((ROOT / "deploy" / "ray" / "dagster.yaml").read_text())
    home = work / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    settings = {
        "DAGSTER_RAY_PY_MODULES": str(ROOT / "examples"),
        "DAGSTER_MAX_CONCURRENT_RUNS": "2",
    }
    site = work / "site"
    site.mkdir()
    (site / "checkpoint_assets").symlink_to(ROOT / "checkpoint_assets")

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    moto.start()
    host, moto_port = moto.get_host_and_port()
    endpoint = f"http://{host}:{moto_port}"
    _s3(endpoint).create_bucket(Bucket="logs")
    keys = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    s3 = s3_env(endpoint)
    try:
        with (
            serve_process(ServerSettings(latency_ms=latency_ms)) as url,
            postgres_server() as pg,
        ):
            base_url = url.removesuffix("/").removesuffix("/v1") + "/v1"
            example = {
                "OPENAI_BASE_URL": base_url,
                "OPENAI_API_KEY": "local",
                "LLM_TICKETS": str(tickets),
                "LLM_MAX_CONCURRENCY": str(concurrency),
            }
            private = {"DAGSTER_PG_PASSWORD": pg["DAGSTER_PG_PASSWORD"], **keys}
            passed = {"PYTHONPATH", *pg, *s3, *settings}
            cluster = {k: v for k, v in os.environ.items() if k not in passed}
            cluster |= private | example | {"PYTHONPATH": str(site)}
            with ray_head(cluster) as address:
                env = {**os.environ, **pg, **s3, **keys, **settings, **example}
                env |= {"DAGSTER_HOME": str(home), "RAY_ADDRESS": address}
                os.environ.update(env)
                import dagster as dg

                dg.DagsterInstance.get()  # the schema, before two processes open it
                source = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "dagster",
                        "asset",
                        "materialize",
                        "-m",
                        MODULE,
                        "--select",
                        "llm_tickets",
                    ],
                    cwd=ROOT,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if source.returncode != 0:
                    raise RuntimeError("llm_tickets failed:\n" + source.stdout[-3000:])
                with dagster_dev(env, work / "dagster_dev.log", work / "workspace.yaml") as port:
                    yield port, base_url, endpoint
    finally:
        moto.stop()


def measure(
    port: int, base_url: str, endpoint: str, tickets: int, latency_ms: float, concurrency: int
) -> dict[str, Any]:
    import dagster as dg
    import polars as pl

    from checkpoint_assets.engine.settings import Settings
    from examples.llm_openai.server import stats
    from examples.ticket_routing.data import generate_tickets

    instance = dg.DagsterInstance.get()
    s3 = _s3(endpoint)
    before = stats(base_url)["ok"]
    backfill = launch_backfill(port, SHARDS, ASSET)
    runs_filter = dg.RunsFilter(tags={"dagster/backfill": backfill})

    # A started run whose shard has a flushed part and no final table yet.
    killed = worker = None
    while killed is None:
        keys = _keys(s3, PREFIX)
        for run in instance.get_runs(runs_filter):
            shard = run.tags["dagster/partition"]
            if (
                run.status == dg.DagsterRunStatus.STARTED
                and any(f"/{shard}.parquet.parts/" in k for k in keys)
                and not any(k.endswith(f"/{shard}.parquet") for k in keys)
            ):
                worker = _run_worker(run.run_id)
                if worker is not None:
                    killed = run
                    break
        time.sleep(0.2)
    assert worker is not None
    shard = killed.tags["dagster/partition"]
    steps = worker.children(recursive=True)
    parts_at_kill = sum(f"/{shard}.parquet.parts/" in k for k in _keys(s3, PREFIX))
    worker.kill()
    kill_time = time.monotonic()
    _, alive = psutil.wait_procs(steps, timeout=120)
    step_seconds = time.monotonic() - kill_time if steps else 0.0
    orphans = [f"{p.pid}: {' '.join(p.cmdline())[:120]}" for p in alive if p.is_running()]

    while True:
        runs = instance.get_runs(runs_filter)
        succeeded = {
            r.tags["dagster/partition"] for r in runs if r.status == dg.DagsterRunStatus.SUCCESS
        }
        failed = Counter(
            r.tags["dagster/partition"] for r in runs if r.status == dg.DagsterRunStatus.FAILURE
        )
        gave_up = [s for s, n in failed.items() if n > MAX_RETRIES and s not in succeeded]
        if (succeeded == set(SHARDS) or gave_up) and all(r.is_finished for r in runs):
            break
        time.sleep(1)
    calls = stats(base_url)["ok"] - before

    stored = pl.concat(
        [
            pl.read_parquet(
                io.BytesIO(s3.get_object(Bucket="logs", Key=f"{PREFIX}{s}.parquet")["Body"].read())
            ).select("ticket_id")
            for s in sorted(succeeded)
        ]
    )
    expected = set(generate_tickets(tickets)["ticket_id"].to_list())
    counts = Counter(stored["ticket_id"].to_list())
    final = instance.get_run_by_id(killed.run_id)
    shard_runs = [r for r in runs if r.tags["dagster/partition"] == shard]
    messages = [
        e.message or ""
        for r in shard_runs
        for e in instance.all_logs(r.run_id)
        if "lock" in (e.message or "").lower() or "launched this step" in (e.message or "")
    ]
    settings = Settings(
        "ticket_id", checkpoint_interval=64, batch_size=1, max_concurrency=concurrency
    )
    bound = settings.loss_bound(
        rows_per_second=concurrency * 1000 / latency_ms,
        store_min_flush_seconds=STORE_MIN_FLUSH_SECONDS,
    )
    return {
        "rows": tickets,
        "ids_stored": stored.height,
        "ids_distinct": len(counts),
        "ids_stored_twice_or_more": sum(1 for n in counts.values() if n > 1),
        "ids_missing": len(expected - set(counts)),
        "calls_counted_by_server": calls,
        "calls_minus_rows": calls - tickets,
        "loss_bound": {
            "rows": bound.rows,
            "calls": bound.calls,
            "buffered": bound.buffered,
            "writing": bound.writing,
            "held": bound.held,
        },
        "within_bound": calls - tickets <= bound.calls,
        "killed_shard": shard,
        "parts_at_kill": parts_at_kill,
        "step_processes_at_kill": len(steps),
        "step_processes_gone_seconds": round(step_seconds, 1),
        "orphans_after_120s": orphans,
        "killed_run_status": final.status.value if final else None,
        "shard_runs": [
            (r.run_id[:8], r.status.value, r.parent_run_id and r.parent_run_id[:8])
            for r in shard_runs
        ],
        "backfill_statuses": dict(Counter(r.status.value for r in runs)),
        "lock_messages": [m[:300] for m in messages],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tickets", type=int, default=2000, help="rows (4 shards)")
    parser.add_argument("--latency-ms", type=float, default=200.0, help="the server's latency")
    parser.add_argument("--concurrency", type=int, default=4, help="calls in flight per shard")
    parser.add_argument("--timeout", type=int, default=900, help="seconds before it gives up")
    args = parser.parse_args()
    # SIGTERM and the timeout stop the services this started, as Ctrl-C does (finally blocks).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(args.timeout)
    with (
        tempfile.TemporaryDirectory(prefix="bench-ray-kill-") as work,
        services(Path(work), args.tickets, args.latency_ms, args.concurrency) as (
            port,
            base_url,
            endpoint,
        ),
    ):
        result = measure(port, base_url, endpoint, args.tickets, args.latency_ms, args.concurrency)
        result["latency_ms"] = args.latency_ms
        result["concurrency"] = args.concurrency
        print(json.dumps(result), flush=True)
    signal.alarm(0)


if __name__ == "__main__":
    main()
