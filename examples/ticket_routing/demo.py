"""Run the ticket-routing demo end to end on the local instance in ``$DAGSTER_HOME``.

1. materialize ``tickets`` (100,000 generated support tickets);
2. backfill every shard of ``ticket_routing`` the way the UI does: ``dagster job backfill``
   submits one run per shard to the instance's run launcher, which starts them as processes;
3. materialize ``routing_summary``, which reads all shards back as one table;
4. print what each shard computed, resumed and failed.

Run it twice: the second run computes nothing, every row is resumed from the checkpoints.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import UTC, datetime

import dagster as dg
import polars as pl

JOB = "ticket_routing_job"
ASSET = dg.AssetKey("ticket_routing")


MODULE = "examples.ticket_routing.definitions"


def _dagster(*args: str) -> None:
    # `dagster asset materialize` loads a module; `dagster job backfill` takes the workspace.
    where = ["-w", "workspace.yaml"] if args[0] == "job" else ["-m", MODULE]
    cmd = [sys.executable, "-m", "dagster", *args, *where]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"`dagster {' '.join(args)}` failed (exit {done.returncode}).")


def _wait_for_backfill(
    instance: dg.DagsterInstance, started: datetime, timeout: float
) -> list[dg.DagsterRun]:
    """The runs of the backfill launched after ``started``, once all have finished."""
    deadline = time.monotonic() + timeout
    while True:
        records = instance.get_run_records(dg.RunsFilter(job_name=JOB, created_after=started))
        runs = [r.dagster_run for r in records if r.dagster_run.tags.get("dagster/backfill")]
        if runs and all(r.is_finished for r in runs):
            return runs
        if time.monotonic() > deadline:
            raise SystemExit(f"The backfill did not finish within {timeout:.0f} s.")
        time.sleep(0.5)


def _stored_summary() -> pl.DataFrame | None:
    """The routing_summary table the last step stored (tickets per department and priority)."""
    base = os.environ.get("CHECKPOINT_BASE_DIR") or os.path.join(
        os.environ["DAGSTER_HOME"], "checkpoints"
    )
    path = os.path.join(base, "routing_summary.parquet")
    return pl.read_parquet(path) if os.path.exists(path) else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for shards")
    args = parser.parse_args()
    if not os.environ.get("DAGSTER_HOME"):
        raise SystemExit("Set DAGSTER_HOME (scripts/demo sets it to ./dagster_home).")
    instance = dg.DagsterInstance.get()
    t0 = time.monotonic()
    _dagster("asset", "materialize", "--select", "tickets")
    started = datetime.now(UTC)
    _dagster("job", "backfill", "-j", JOB, "--all", "all", "--noprompt")
    runs = _wait_for_backfill(instance, started, args.timeout)
    failed = [r for r in runs if r.status != dg.DagsterRunStatus.SUCCESS]
    _dagster("asset", "materialize", "--select", "routing_summary")
    elapsed = time.monotonic() - t0

    records = {
        key: instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=ASSET, asset_partitions=[key]), limit=1
        ).records
        for key in sorted({r.tags.get("dagster/partition", "") for r in runs})
    }
    rows = []
    for key, found in records.items():
        meta = found[0].asset_materialization.metadata if found else {}  # type: ignore[union-attr]
        rows.append(
            {
                "shard": key,
                **{
                    k: meta[k].value
                    for k in ("rows_total", "rows_computed", "rows_resumed", "rows_failed")
                    if k in meta
                },
            }
        )
    table = pl.DataFrame(rows)
    with pl.Config(tbl_rows=20, tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        print(table)
    totals = table.select(pl.exclude("shard").sum()).row(0, named=True)
    print(
        f"{len(runs)} shard runs ({len(failed)} failed) in {elapsed:.1f} s: "
        f"{totals.get('rows_total', 0):,} tickets, {totals.get('rows_computed', 0):,} computed "
        f"now, {totals.get('rows_resumed', 0):,} resumed from checkpoints, "
        f"{totals.get('rows_failed', 0):,} failed."
    )
    summary = _stored_summary()
    if summary is not None:
        with pl.Config(tbl_rows=30, tbl_hide_dataframe_shape=True):
            print(summary.pivot("priority", index="department", values="tickets").fill_null(0))
    if failed:
        print(
            "Failed shards are retried by `failed_partitions_sensor` under `dagster dev`, or "
            "by running this demo again (it resumes)."
        )
    print(
        "Open the UI with:  DAGSTER_HOME=$PWD/dagster_home .venv/bin/dagster dev -w workspace.yaml"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
