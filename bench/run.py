"""Run the benchmark: ``python -m bench.run`` (or ``python bench/run.py``) from the repository.

Every scenario is measured against a baseline in the same run, so a busy machine
slows both sides alike. The table goes to stdout and the figures to
``bench/results/<timestamp>.json``. Sizes are flags; ``--smoke`` is a tiny version that finishes in
seconds (CI runs it; it times nothing that is asserted).

    python -m bench.run                                  # the full run (several minutes)
    python -m bench.run --smoke                          # seconds
    python -m bench.run --only resume,hashing --resume-rows 1000000,10000000
    python -m bench.run --only sensor_tick,status         # scaling: 100 / 1,000 / 3,000 shards
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import remote, report, reshard, s3_requests, scenarios, sensor_tick, status_scale
from bench.report import Result
from bench.scenarios import Sizes

SCENARIOS = (
    "overhead",
    "per_call",
    "resume",
    "compaction",
    "s3_requests",
    "hashing",
    "ray",
    "distribatch",
    "remote",
    "reshard",
    "global_table",
)
# Scaling figures, only with --only: minutes each, and the sensor's starts a PostgreSQL server.
ON_REQUEST = ("sensor_tick", "status")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--rows", type=int, help="rows of the overhead, compaction, s3_requests and Ray jobs (1M)"
    )
    p.add_argument("--interval", type=int, help="checkpoint_interval of the overhead job (10000)")
    p.add_argument("--per-call-rows", type=int, help="rows of the per-call job (20000)")
    p.add_argument("--per-call-interval", type=int, help="rows per call and flush (16)")
    p.add_argument("--per-call-sleep", type=float, help="seconds the function sleeps (0.02)")
    p.add_argument("--resume-rows", help="comma-separated sizes of finished checkpoints (1M,10M)")
    p.add_argument("--compaction-interval", type=int, help="rows per flush, compaction (16)")
    p.add_argument("--hash-rows", type=int, help="rows hashed (10M)")
    p.add_argument("--remote-rows", type=int, help="rows of each remote-model run (3200)")
    p.add_argument("--reshard-rows", type=int, help="rows of the 64->48 and 8->1000 reshards (1M)")
    p.add_argument(
        "--global-rows", help="comma-separated rows of the global resume asset (10M,30M)"
    )
    p.add_argument(
        "--global-checkpoints", type=int, help="checkpoints the global resume asset reads (256)"
    )
    p.add_argument(
        "--repeat",
        type=int,
        help="repetitions; medians are reported, with the spread (3; overhead: 5, per_call and"
        " hashing: 2 at least, alternating which side runs first)",
    )
    p.add_argument("--sensor-shards", default="100,1000,3000", help="shard counts of sensor_tick")
    p.add_argument(
        "--sensor-instances", default="sqlite,postgres", help="instance storages of sensor_tick"
    )
    p.add_argument(
        "--status-checkpoints", default="100,1000,3000", help="checkpoint counts of status"
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for CI (seconds)")
    every = ",".join(SCENARIOS + ON_REQUEST)
    p.add_argument("--only", help=f"comma-separated scenarios to run ({every})")
    p.add_argument(
        "--ray",
        action="store_true",
        help="run the peers' scenarios (Ray Data, distribatch) in a smoke run too",
    )
    p.add_argument("--workdir", help="where checkpoints are written (default: a temp folder)")
    p.add_argument("--results", default=RESULTS, help="folder of the JSON results")
    return p.parse_args(argv)


def sizes_from(args: argparse.Namespace) -> Sizes:
    smoke = args.smoke
    resume_rows = args.resume_rows or ("1000,10000" if smoke else "1000000,10000000")
    global_rows = args.global_rows or ("2560,5120" if smoke else "10000000,30000000")

    def pick(value: int | float | None, full: int | float, tiny: int | float) -> int | float:
        return value if value is not None else (tiny if smoke else full)

    return Sizes(
        rows=int(pick(args.rows, 1_000_000, 2_000)),
        interval=int(pick(args.interval, 10_000, 100)),
        per_call_rows=int(pick(args.per_call_rows, 20_000, 160)),
        per_call_interval=int(pick(args.per_call_interval, 16, 16)),
        per_call_sleep=float(pick(args.per_call_sleep, 0.02, 0.001)),
        resume_rows=tuple(int(float(r)) for r in resume_rows.split(",") if r.strip()),
        compaction_interval=int(pick(args.compaction_interval, 16, 16)),
        hash_rows=int(pick(args.hash_rows, 10_000_000, 10_000)),
        repeat=int(pick(args.repeat, 3, 1)),
        remote_rows=int(pick(args.remote_rows, 3200, 96)),
        reshard_rows=int(pick(args.reshard_rows, 1_000_000, 4_000)),
        reshard_sample=int(pick(None, reshard.SAMPLE, 4)),
        global_rows=tuple(int(float(r)) for r in global_rows.split(",") if r.strip()),
        global_checkpoints=int(pick(args.global_checkpoints, 256, 16)),
        overhead_rounds=int(pick(None, 5, 1)),
        overhead_warmup=int(pick(None, 1, 0)),
    )


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(float(n)) for n in text.split(",") if n.strip())


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sizes = sizes_from(args)
    chosen = [s.strip() for s in args.only.split(",")] if args.only else list(SCENARIOS)
    unknown = sorted(set(chosen) - set(SCENARIOS + ON_REQUEST))
    if unknown:
        choices = ", ".join(SCENARIOS + ON_REQUEST)
        print(f"unknown scenarios {unknown}; choose from {choices}", file=sys.stderr)
        return 2
    workdir = args.workdir or tempfile.mkdtemp(prefix="checkpoint-assets-bench-")
    os.makedirs(workdir, exist_ok=True)
    runs: dict[str, Callable[[], list[Result]]] = {
        "overhead": lambda: [scenarios.overhead(sizes, workdir, args.ray or not args.smoke)],
        "per_call": lambda: [scenarios.per_call(sizes, workdir)],
        "resume": lambda: list(scenarios.resume(sizes, workdir)),
        "compaction": lambda: [scenarios.compaction(sizes, workdir)],
        "s3_requests": lambda: [s3_requests.s3_requests(sizes.rows)],
        "hashing": lambda: [scenarios.hashing_speed(sizes, workdir)],
        "ray": lambda: [scenarios.ray_data(sizes, workdir, enabled=args.ray or not args.smoke)],
        "distribatch": lambda: [
            scenarios.distribatch_peer(sizes, workdir, enabled=args.ray or not args.smoke)
        ],
        "remote": lambda: remote.all_scenarios(sizes.remote_rows, workdir),
        "sensor_tick": lambda: sensor_tick.sensor_tick(
            _counts(args.sensor_shards), sizes.repeat, tuple(args.sensor_instances.split(","))
        ),
        "status": lambda: [
            status_scale.status_scale(_counts(args.status_checkpoints), workdir, sizes.repeat)
        ],
        "reshard": lambda: [reshard.reshard(sizes.reshard_rows, sizes.reshard_sample, workdir)],
        "global_table": lambda: [
            reshard.global_table(sizes.global_rows, sizes.global_checkpoints, workdir)
        ],
    }
    started = datetime.datetime.now(datetime.UTC)
    results: list[Result] = []
    seconds: dict[str, float] = {}
    try:
        for key in chosen:
            print(f"-- {key} ...", file=sys.stderr, flush=True)
            t = time.perf_counter()
            try:
                results.extend(runs[key]())
            except Exception as e:  # one broken scenario must not hide the others' figures
                traceback.print_exc()
                results.append(Result(key, key, status="error", note=f"{type(e).__name__}: {e}"))
            seconds[key] = time.perf_counter() - t
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(report.table(results))
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(args.results, f"{stamp}.json")
    report.write_json(
        path,
        {
            "started": started.isoformat(),
            "command": " ".join(["python", "-m", "bench.run", *sys.argv[1:]]),
            "environment": report.environment(),
            "sizes": sizes.__dict__,
            "scenario_seconds": seconds,
            "scenarios": {r.key: r.as_dict() for r in results},
        },
    )
    print(f"\nresults: {path}")
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
