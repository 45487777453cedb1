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
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import IO

import dagster as dg
import polars as pl

from checkpoint_assets.engine.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.layout import checkpoint_name
from checkpoint_assets.engine.storage import open_store
from examples.ticket_routing.definitions import SHARDS

JOB = "ticket_routing_job"
ASSET = dg.AssetKey("ticket_routing")


MODULE = "examples.ticket_routing.definitions"


def _say(message: str) -> None:
    print(message, flush=True)


def _command(*args: str) -> list[str]:
    # `dagster asset materialize` loads a module; `dagster job backfill` takes the workspace.
    where = ["-w", "workspace.yaml"] if args[0] == "job" else ["-m", MODULE]
    return [sys.executable, "-m", "dagster", *args, *where]


def _check(args: Sequence[str], returncode: int, output: str) -> None:
    if returncode != 0:
        sys.stderr.write(output[-8000:])
        raise SystemExit(f"`dagster {' '.join(args)}` failed (exit {returncode}).")


def _dagster(step: str, *args: str) -> None:
    _say(f"{step}: dagster {' '.join(args)} ...")
    t0 = time.monotonic()
    done = subprocess.run(_command(*args), capture_output=True, text=True)
    _check(args, done.returncode, done.stdout + done.stderr)
    _say(f"{step}: done in {time.monotonic() - t0:.1f} s")


def _rows_checkpointed(base_dir: str, keys: Sequence[str]) -> int | None:
    """Rows the shards' checkpoints hold so far (parts included), or None if unreadable now."""
    store = open_store(base_dir)
    total = 0
    for key in keys:
        checkpoint = Checkpoint(store, checkpoint_name(ASSET.path, None, key))
        try:
            meta = checkpoint.meta_file.read()
            if meta is not None:
                total += checkpoint.load("ticket_id", meta.base_seq).rows.height
        except (OSError, CheckpointError):
            return None  # a part merged away while we read: try again next time
    return total


def _wait_for_backfill(
    instance: dg.DagsterInstance,
    started: datetime,
    timeout: float,
    launcher: subprocess.Popen[str],
    output: IO[str],
    every: float = 5.0,
) -> list[dg.DagsterRun]:
    """The runs of the backfill launched after ``started`` (by ``launcher``, which starts them
    one by one), once all have finished; says how far they are every few seconds."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    last_said = t0
    keys = SHARDS.get_partition_keys()
    total_rows = int(os.environ.get("DEMO_TICKETS", "100000"))
    while True:
        records = instance.get_run_records(dg.RunsFilter(job_name=JOB, created_after=started))
        runs = [r.dagster_run for r in records if r.dagster_run.tags.get("dagster/backfill")]
        launching = launcher.poll() is None
        if not launching and launcher.returncode != 0:
            output.seek(0)
            _check(["job", "backfill"], launcher.returncode, output.read())
        if not launching and len(runs) >= len(keys) and all(r.is_finished for r in runs):
            return runs
        now = time.monotonic()
        if now > deadline:
            raise SystemExit(f"The backfill did not finish within {timeout:.0f} s.")
        if now - last_said >= every:
            last_said = now
            finished = sum(r.is_finished for r in runs)
            running = sum(r.status == dg.DagsterRunStatus.STARTED for r in runs)
            rows = _rows_checkpointed(_base_dir(), keys)
            done = f", {rows:,} / {total_rows:,} rows checkpointed" if rows is not None else ""
            _say(
                f"  {now - t0:5.0f} s: {len(runs)} of {len(keys)} shard runs launched, "
                f"{running} running, {finished} finished{done}"
            )
        time.sleep(0.5)


def _base_dir() -> str:
    return os.environ.get("CHECKPOINT_BASE_DIR") or os.path.join(
        os.environ["DAGSTER_HOME"], "checkpoints"
    )


def _stored_summary() -> pl.DataFrame | None:
    """The routing_summary table the last step stored (tickets per department and priority)."""
    path = os.path.join(_base_dir(), "routing_summary.parquet")
    return pl.read_parquet(path) if os.path.exists(path) else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for shards")
    args = parser.parse_args()
    if not os.environ.get("DAGSTER_HOME"):
        raise SystemExit("Set DAGSTER_HOME (scripts/demo sets it to ./dagster_home).")
    instance = dg.DagsterInstance.get()
    t0 = time.monotonic()
    _dagster("1/3 tickets", "asset", "materialize", "--select", "tickets")
    started = datetime.now(UTC)
    backfill = ["job", "backfill", "-j", JOB, "--all", "all", "--noprompt"]
    _say(
        f"2/3 shards: dagster {' '.join(backfill)} starts one run per shard, each in its own "
        "process ..."
    )
    t0_shards = time.monotonic()
    with tempfile.TemporaryFile("w+") as output:
        launcher = subprocess.Popen(
            _command(*backfill), stdout=output, stderr=subprocess.STDOUT, text=True
        )
        runs = _wait_for_backfill(instance, started, args.timeout, launcher, output)
    failed = [r for r in runs if r.status != dg.DagsterRunStatus.SUCCESS]
    _say(f"2/3 shards: all finished in {time.monotonic() - t0_shards:.1f} s")
    _dagster("3/3 summary", "asset", "materialize", "--select", "routing_summary")
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
