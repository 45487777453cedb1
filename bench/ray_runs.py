"""What a run costs on Ray with deploy/ray/dagster.yaml: start cost, Postgres, events, daemon CPU.

    python -m bench.ray_runs                  # backfills of 1, 8 and 64 runs, 16 at once
    python -m bench.ray_runs --runs 1,8 --at-once 8 --in-process

Real processes on 127.0.0.1, as tests/e2e/test_ray_postgres.py starts them: PostgreSQL, moto's
S3 (compute logs), a 2-CPU Ray head started in a temp dir, and `dagster dev` with
deploy/ray/dagster.yaml (its launcher, run monitoring every 5 s, compute logs on S3). The code
location is one partitioned asset that imports checkpoint_assets and returns at once, shipped to
the jobs through the launcher's runtime_env. Each size is one UI backfill (GraphQL);
``max_concurrent_runs`` is ``--at-once`` and the runs' ``num_cpus`` 2 / ``--at-once``, so that
many run at once (64 runs at once would need about 24 GB here: about 370 MB per run).

Counted, not timed, where possible (the machine is shared): peak Postgres connections
(pg_stat_activity, sampled every 0.2 s), events written per run (by type), CPU seconds of the
daemon, of the Ray cluster's processes (including exited children, so the runs) and of Postgres,
each less its idle rate measured for 20 s just before, and the Ray cluster's peak memory above
idle. Wall times are given for what they are on a loaded machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
for folder in ("tests", "tests/e2e"):
    sys.path.insert(0, str(ROOT / folder))
from deploy_services import dagster_dev, postgres_server, ray_head  # noqa: E402
from helpers.graphql import launch_backfill  # noqa: E402

PARTITIONS = 64
IDLE_SECONDS = 20.0
CODE = '''
"""A run that computes nothing: the fixed cost of a run (package imported, asset returns)."""
import dagster as dg
import checkpoint_assets  # noqa: F401 - a shard run imports it

@dg.asset(partitions_def=dg.StaticPartitionsDefinition([str(i) for i in range({n})]))
def noop() -> None:
    """Returns at once."""

defs = dg.Definitions(assets=[noop]{executor})
'''


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU of ``processes`` and of their exited (reaped) children."""
    total = 0.0
    for p in processes:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


class Sampler(threading.Thread):
    """Peak Postgres connections and peak RSS of the Ray cluster, sampled every 0.2 s."""

    def __init__(self, pg: dict[str, str], ray_pid: int) -> None:
        super().__init__(daemon=True)
        import psycopg2

        self.db = psycopg2.connect(
            host=pg["DAGSTER_PG_HOST"],
            port=pg["DAGSTER_PG_PORT"],
            user=pg["DAGSTER_PG_USER"],
            password=pg["DAGSTER_PG_PASSWORD"],
            dbname=pg["DAGSTER_PG_DB"],
        )
        self.db.autocommit = True
        self.ray_pid = ray_pid
        self.peak_connections = 0
        self.peak_ray_rss = 0
        self.run_cpu: dict[int, tuple[str, float]] = {}  # pid: (role, CPU seconds so far)
        self.stop = threading.Event()

    def run(self) -> None:
        with self.db.cursor() as cur:
            while not self.stop.is_set():
                cur.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> "
                    "pg_backend_pid()",
                    ("dagster",),
                )
                self.peak_connections = max(self.peak_connections, cur.fetchone()[0])
                rss = 0
                for p in tree(self.ray_pid):
                    with contextlib.suppress(psutil.Error):
                        rss += p.memory_info().rss
                        role = _role(p.cmdline())
                        if role:
                            t = p.cpu_times()
                            self.run_cpu[p.pid] = (role, t.user + t.system)
                self.peak_ray_rss = max(self.peak_ray_rss, rss)
                time.sleep(0.2)

    def cpu_by_role(self) -> Counter[str]:
        """CPU seconds of the runs' processes, by role (the last 0.2 s of each is missed)."""
        total: Counter[str] = Counter()
        for role, seconds in self.run_cpu.values():
            total[role] += seconds
        return total

    def sessions(self) -> int:
        """Connections Postgres has accepted into the database so far."""
        with self.db.cursor() as cur:
            cur.execute("SELECT sessions FROM pg_stat_database WHERE datname = %s", ("dagster",))
            return int(cur.fetchone()[0])

    def events(self, run_ids: list[str]) -> Counter[str]:
        with self.db.cursor() as cur:
            cur.execute(
                "SELECT dagster_event_type, count(*) FROM event_logs WHERE run_id = ANY(%s) "
                "GROUP BY 1",
                (run_ids,),
            )
            return Counter({str(k): int(v) for k, v in cur.fetchall()})


def _role(cmdline: list[str]) -> str | None:
    """Which process of a run this is: its Ray job's supervisor, the run worker, a step."""
    text = " ".join(cmdline)
    if "JobSupervisor" in text:
        return "ray_job_supervisor"
    if "api execute_run" in text and not text.startswith("/bin/sh"):
        return "run_worker"
    if "multiprocessing" in text and "ray.dashboard" not in text:
        return "step_worker"  # the multiprocess executor's forkserver and its step processes
    return None


def _daemon(dev_pid: int) -> list[psutil.Process]:
    return [
        p
        for p in tree(dev_pid)
        if any("dagster-daemon" in part or "_daemon" in part for part in p.cmdline())
    ]


def _postmaster(pg: dict[str, str]) -> list[psutil.Process]:
    port = pg["DAGSTER_PG_PORT"]
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if "postgres" in cmd and f"-p {port}" in cmd:
            return tree(p.pid)
    return []


def measure(n: int, port: int, dev_pid: int, ray_pid: int, pg: dict[str, str]) -> dict[str, Any]:
    import dagster as dg

    instance = dg.DagsterInstance.get()
    daemon, postgres = _daemon(dev_pid), _postmaster(pg)

    def cpu() -> list[float]:
        return [cpu_seconds(daemon), cpu_seconds(tree(ray_pid)), cpu_seconds(postgres)]

    # The background of each (Ray's dashboard and agents, the daemon's loops), to subtract.
    idle_rss = sum(p.memory_info().rss for p in tree(ray_pid))
    sampler = Sampler(pg, ray_pid)
    before, idle_started = [*cpu(), sampler.sessions()], time.monotonic()
    time.sleep(IDLE_SECONDS)
    now = [*cpu(), sampler.sessions()]
    idle = [(a - b) / (time.monotonic() - idle_started) for a, b in zip(now, before, strict=True)]
    before, sessions = now[:3], now[3]
    sampler.start()
    started = time.monotonic()
    backfill = launch_backfill(port, [str(i) for i in range(n)], "noop")
    runs_filter = dg.RunsFilter(tags={"dagster/backfill": backfill})
    while True:
        runs = instance.get_runs(runs_filter)
        if len(runs) == n and all(r.is_finished for r in runs):
            break
        if time.monotonic() - started > 1800:
            raise TimeoutError(
                f"{n} runs not finished in 30 min: {Counter(r.status for r in runs)}"
            )
        time.sleep(1)
    seconds = time.monotonic() - started
    after = cpu()  # the cluster's processes now, with the runs' exited ones reaped
    used = [a - b - rate * seconds for a, b, rate in zip(after, before, idle[:3], strict=True)]
    sampler.stop.set()
    sampler.join()
    sessions = sampler.sessions() - sessions - idle[3] * seconds
    from ray.job_submission import JobSubmissionClient

    jobs = JobSubmissionClient(os.environ["RAY_ADDRESS"]).list_jobs()
    run_ids = [r.run_id for r in runs]
    events = sampler.events(run_ids)
    stats = [instance.get_run_stats(i) for i in run_ids]
    starting = sorted((s.start_time or 0) - (s.launch_time or 0) for s in stats)
    started_to_end = sorted((s.end_time or 0) - (s.start_time or 0) for s in stats)
    return {
        "runs": n,
        "statuses": dict(Counter(str(r.status.value) for r in runs)),
        "peak_postgres_connections": sampler.peak_connections,
        "postgres_sessions_per_run": sessions / n,
        "run_process_cpu_seconds_per_run": {k: v / n for k, v in sampler.cpu_by_role().items()},
        "ray_jobs_listed": len(jobs),
        "ray_job_list_bytes": len(str(jobs)),
        "events_per_run": sum(events.values()) / n,
        "events_by_type_per_run": {k: v / n for k, v in events.most_common()},
        "daemon_cpu_seconds": used[0],
        "ray_cpu_seconds_per_run": used[1] / n,
        "postgres_cpu_seconds_per_run": used[2] / n,
        "idle_per_second_cpu_daemon_ray_postgres_and_sessions": idle,
        "peak_ray_rss_mib_above_idle": (sampler.peak_ray_rss - idle_rss) / 2**20,
        "wall_seconds": seconds,
        "starting_seconds_median_max": [starting[n // 2], starting[-1]],
        "started_to_end_seconds_median_max": [started_to_end[n // 2], started_to_end[-1]],
        "load_average": os.getloadavg(),
    }


@contextlib.contextmanager
def services(work: Path, at_once: int, in_process: bool) -> Iterator[tuple[int, int, dict]]:
    from moto.server import ThreadedMotoServer

    code = work / "code" / "noop_defs"
    code.mkdir(parents=True)
    executor = ", executor=dg.in_process_executor" if in_process else ""
    (code / "__init__.py").write_text(textwrap.dedent(CODE.format(n=PARTITIONS, executor=executor)))
    (work / "workspace.yaml").write_text(
        "load_from:\n  - python_module:\n      module_name: noop_defs\n"
        f"      working_directory: {work / 'code'}\n"
    )
    config = yaml.safe_load((ROOT / "deploy" / "ray" / "dagster.yaml").read_text())
    launcher = config["run_launcher"]["config"]["ray"]
    launcher["num_cpus"] = int(2 / at_once * 1000) / 1000  # `at_once` runs fit the 2 CPUs
    settings = {"DAGSTER_RAY_PY_MODULES": str(code), "DAGSTER_MAX_CONCURRENT_RUNS": str(at_once)}
    config["run_monitoring"]["start_timeout_seconds"] = 1800
    home = work / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    moto.start()
    host, moto_port = moto.get_host_and_port()
    endpoint = f"http://{host}:{moto_port}"
    keys = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    import boto3

    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", **_lower(keys)
    ).create_bucket(Bucket="logs")
    site = work / "site"
    site.mkdir()
    (site / "checkpoint_assets").symlink_to(ROOT / "checkpoint_assets")
    s3 = s3_env(endpoint)
    try:
        with postgres_server() as pg:
            private = {"DAGSTER_PG_PASSWORD": pg["DAGSTER_PG_PASSWORD"], **keys}
            passed = {"PYTHONPATH", *pg, *s3, *settings}
            cluster = {k: v for k, v in os.environ.items() if k not in passed}
            cluster |= private | {"PYTHONPATH": str(site)}
            with ray_head(cluster) as address:
                env = {**os.environ, **pg, **s3, **keys, **settings, "DAGSTER_HOME": str(home)}
                env["RAY_ADDRESS"] = address
                os.environ.update(env)
                ray_pid = _ray_start_pid(address)
                with dagster_dev(env, work / "dagster_dev.log", work / "workspace.yaml") as port:
                    dev_pid = next(
                        p.pid
                        for p in psutil.process_iter(["cmdline"])
                        if {"dev", str(port)} <= set(p.info["cmdline"] or ())
                    )
                    yield port, dev_pid, pg | {"ray_pid": str(ray_pid)}
    finally:
        moto.stop()


def s3_env(endpoint: str) -> dict[str, str]:
    """The variables deploy/ray/dagster.yaml reads for S3 (compute logs, checkpoints) on moto at
    ``endpoint``, bucket ``logs``."""
    return {
        "DAGSTER_COMPUTE_LOG_BUCKET": "logs",
        "CHECKPOINT_BASE_DIR": "s3://logs/checkpoints",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }


def _lower(keys: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in keys.items()}


def _ray_start_pid(address: str) -> int:
    port = address.rsplit(":", 1)[1]
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if f"--dashboard-port={port}" in cmd and any(c.endswith("/ray") for c in cmd[:2]):
            return int(p.pid)
    raise RuntimeError("the Ray head's `ray start` process was not found")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="1,8,64", help="backfill sizes, in order")
    parser.add_argument("--at-once", type=int, default=16, help="max_concurrent_runs")
    parser.add_argument("--in-process", action="store_true", help="in_process_executor")
    args = parser.parse_args()
    sizes = [int(n) for n in args.runs.split(",")]
    # SIGTERM stops the services this started, as Ctrl-C does (finally blocks run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with (
        tempfile.TemporaryDirectory(prefix="bench-ray-") as work,
        services(Path(work), args.at_once, args.in_process) as (port, dev_pid, pg),
    ):
        ray_pid = int(pg.pop("ray_pid"))
        for n in sizes:
            result = measure(n, port, dev_pid, ray_pid, pg)
            result["executor"] = "in_process" if args.in_process else "multiprocess"
            result["max_concurrent_runs"] = args.at_once
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
