"""A backfill of every shard through ``dagster-daemon``, in ranged runs: runs, wall time, events.

``python -m bench.daemon_backfill [--shards 1024] [--per-run 64] [--runs-at-once 2]``

In a fresh ``DAGSTER_HOME`` (SQLite, local disk, the default run launcher: each run a process),
``tickets`` is materialized in this process, then an asset backfill of every shard of ``scored``
is added as the UI's "Materialize all" adds it, and the daemon launches its runs:
``BackfillPolicy.multi_run(per_run)`` makes them ranged runs of ``per_run`` shards. Reported:
the runs launched, the wall time from the request to the backfill's end, the shards
materialized, and the instance's events per shard (every event of the backfill's runs,
divided by the shards). The function does next to nothing: what is measured is Dagster's and
the package's cost per run and per shard.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = "bench.daemon_backfill_defs"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=1024)
    p.add_argument("--per-run", type=int, default=64)
    p.add_argument("--rows-per-shard", type=int, default=20)
    p.add_argument("--runs-at-once", type=int, default=2, help="the run queue's limit")
    p.add_argument("--timeout", type=float, default=3600.0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-daemon-backfill-") as home:
        with open(os.path.join(home, "dagster.yaml"), "w") as f:
            f.write(
                "telemetry:\n  enabled: false\n"
                f"run_queue:\n  max_concurrent_runs: {args.runs_at_once}\n"
            )
        os.environ.update(
            DAGSTER_HOME=home,
            BENCH_SHARDS=str(args.shards),
            BENCH_PER_RUN=str(args.per_run),
            BENCH_ROWS=str(args.shards * args.rows_per_shard),
        )
        figures = _backfill(home, args.timeout)
    figures.update(shards=args.shards, per_run=args.per_run, runs_at_once=args.runs_at_once)
    print(json.dumps(figures, indent=2))
    return 0 if figures["shards_materialized"] == args.shards else 1


def _backfill(home: str, timeout: float) -> dict[str, Any]:
    import dagster as dg
    from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
    from dagster._core.utils import make_new_backfill_id

    from bench.daemon_backfill_defs import defs, scored, tickets

    with dg.DagsterInstance.get() as instance:
        quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
        stored = dg.materialize(
            [tickets, scored], selection=[tickets], resources=defs.resources, run_config=quiet
        )
        assert stored.success
        daemon_bin = os.path.join(os.path.dirname(sys.executable), "dagster-daemon")
        daemon = subprocess.Popen(
            [daemon_bin, "run", "-m", MODULE, "-d", REPO],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            backfill_id = make_new_backfill_id()
            started = time.monotonic()
            instance.add_backfill(
                PartitionBackfill.from_asset_partitions(
                    backfill_id=backfill_id,
                    asset_graph=defs.resolve_asset_graph(),
                    partition_names=None,
                    asset_selection=[scored.key],
                    backfill_timestamp=time.time(),
                    tags={},
                    dynamic_partitions_store=instance,
                    all_partitions=True,
                    title="bench.daemon_backfill",
                    description=None,
                    run_config=None,
                )
            )
            while True:
                backfill = instance.get_backfill(backfill_id)
                if backfill is not None and backfill.status != BulkActionStatus.REQUESTED:
                    break
                if time.monotonic() - started > timeout:
                    raise TimeoutError(f"the backfill did not end in {timeout:.0f} s")
                time.sleep(2)
            wall = time.monotonic() - started
        finally:
            os.killpg(daemon.pid, 9)  # the daemon, its code server and any run left
            daemon.wait(timeout=30)
        runs = list(instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill_id})))
        events = sum(len(instance.all_logs(r.run_id)) for r in runs)
        materialized = len(instance.get_materialized_partitions(scored.key))
        shards = len(scored.partitions_def.get_partition_keys())  # type: ignore[union-attr]
        return {
            "backfill_status": str(backfill.status.value) if backfill else "gone",
            "runs": len(runs),
            "runs_failed": sum(r.status == dg.DagsterRunStatus.FAILURE for r in runs),
            "source_columns": _columns(home),
            "wall_seconds": round(wall, 1),
            "shards_materialized": materialized,
            "events": events,
            "events_per_shard": round(events / shards, 2),
        }


def _columns(home: str) -> str:
    """The stored source's columns: keyed by ``scored``'s id when it has its shard key column."""
    import pyarrow.parquet as pq

    return ",".join(pq.read_schema(os.path.join(home, "checkpoints", "tickets.parquet")).names)


if __name__ == "__main__":
    sys.exit(main())
