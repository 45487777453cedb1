"""Run the ticket-routing demo end to end on the local instance in ``$DAGSTER_HOME``.

1. materialize ``tickets`` (100,000 generated support tickets) in this process, unless the
   instance holds them;
2. backfill every shard of ``ticket_routing`` the way the UI's "Materialize all" does: an asset
   backfill, launched by Dagster's daemon. The asset's single-run backfill policy makes it one run
   that walks the 8 shards;
3. materialize ``routing_summary`` in this process, which reads all shards back as one table;
4. print what each shard computed, resumed and failed.

Run it twice: the second run computes nothing, every row is resumed from the checkpoints.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from typing import IO

import dagster as dg
import polars as pl

# The two calls the UI's launchPartitionBackfill mutation makes (Dagster has no public one).
from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
from dagster._core.utils import make_new_backfill_id

from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.layout import checkpoint_name
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.storage import open_store

# The demo prints its own lines only: not Dagster's BetaWarning about the asset's backfill policy
# (the policy makes the backfill one run), nor the DEBUG lines of the run it makes in this process
# (QUIET: they stay in that run's logs, in the UI).
warnings.filterwarnings("ignore", category=dg.BetaWarning)
from examples.ticket_routing.definitions import SHARDS, defs  # noqa: E402

QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}

ASSET = dg.AssetKey("ticket_routing")
DAEMON = os.path.join(os.path.dirname(sys.executable), "dagster-daemon")


def _say(message: str) -> None:
    print(message, flush=True)


def _check(args: Sequence[str], returncode: int, output: str) -> None:
    if returncode != 0:
        sys.stderr.write(output[-8000:])
        raise SystemExit(f"`{' '.join(args)}` failed (exit {returncode}).")


def _in_process(step: str, instance: dg.DagsterInstance, asset: str) -> None:
    """Materialize ``asset`` in this process, on ``instance``: no process to start."""
    _say(f"{step}: materialize {asset} in this process ...")
    t0 = time.monotonic()
    job = defs.resolve_implicit_global_asset_job_def()
    job.execute_in_process(
        instance=instance, asset_selection=[dg.AssetKey(asset)], run_config=QUIET
    )
    _say(f"{step}: done in {time.monotonic() - t0:.1f} s")


def _tickets_stored(instance: dg.DagsterInstance, wanted: int) -> bool:
    """Whether the instance's latest ``tickets`` holds ``wanted`` rows and its file is there."""
    event = instance.get_latest_materialization_event(dg.AssetKey("tickets"))
    stored = event.asset_materialization if event else None
    if stored is None or "rows" not in stored.metadata:
        return False
    exists = os.path.exists(os.path.join(_base_dir(), "tickets.parquet"))
    return exists and stored.metadata["rows"].value == wanted


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


def _launch_backfill(instance: dg.DagsterInstance) -> str:
    """Request a backfill of every shard, as the UI does; the daemon launches its runs."""
    backfill_id = make_new_backfill_id()
    instance.add_backfill(
        PartitionBackfill.from_asset_partitions(
            backfill_id=backfill_id,
            asset_graph=defs.resolve_asset_graph(),
            partition_names=None,
            asset_selection=[ASSET],
            backfill_timestamp=time.time(),
            tags={},
            dynamic_partitions_store=instance,
            all_partitions=True,
            title="scripts/demo",
            description=None,
            run_config=None,
        )
    )
    return backfill_id


def _shards_done(instance: dg.DagsterInstance, runs: Sequence[dg.DagsterRun]) -> bool:
    """Whether every shard has materialized in one of ``runs``."""
    ids = {r.run_id for r in runs}
    done = set()
    for key in SHARDS.get_partition_keys():
        found = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=ASSET, asset_partitions=[key]), limit=1
        ).records
        if found and found[0].run_id in ids:
            done.add(key)
    return len(done) == len(SHARDS.get_partition_keys())


def _wait_for_backfill(
    instance: dg.DagsterInstance,
    backfill_id: str,
    timeout: float,
    daemon: subprocess.Popen[str],
    output: IO[str],
    every: float = 5.0,
) -> list[dg.DagsterRun]:
    """The runs of the backfill once they have finished (a run retried by the instance's
    ``run_retries`` counts with its retry); says how far they are every few seconds."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    last_said = t0
    keys = SHARDS.get_partition_keys()
    total_rows = int(os.environ.get("DEMO_TICKETS", "100000"))
    while True:
        if daemon.poll() is not None:
            output.seek(0)
            _check(["dagster-daemon", "run"], daemon.returncode or 1, output.read())
        runs = list(instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill_id})))
        backfill = instance.get_backfill(backfill_id)
        ended = backfill is not None and backfill.status != BulkActionStatus.REQUESTED
        finished = bool(runs) and all(r.is_finished for r in runs)
        if finished and (ended or _shards_done(instance, runs)):
            return runs
        now = time.monotonic()
        if now > deadline:
            raise SystemExit(f"The backfill did not finish within {timeout:.0f} s.")
        if now - last_said >= every:
            last_said = now
            running = sum(r.status == dg.DagsterRunStatus.STARTED for r in runs)
            rows = _rows_checkpointed(_base_dir(), keys)
            done = f", {rows:,} / {total_rows:,} rows checkpointed" if rows is not None else ""
            _say(
                f"  {now - t0:5.0f} s: {len(runs)} run(s) launched, {running} running, "
                f"{sum(r.is_finished for r in runs)} finished{done}"
            )
        time.sleep(0.5)


def _stop(daemon: subprocess.Popen[str]) -> None:
    """Stop the daemon and the code server it started (one process group)."""
    if daemon.poll() is None:
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()


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
    wanted = int(os.environ.get("DEMO_TICKETS", "100000"))
    if _tickets_stored(instance, wanted):
        _say(f"1/3 tickets: {wanted:,} stored, kept (delete dagster_home to generate them again)")
    else:
        _in_process("1/3 tickets", instance, "tickets")
    backfill_id = _launch_backfill(instance)
    _say(
        f"2/3 shards: backfill {backfill_id} of all {len(SHARDS.get_partition_keys())} shards, "
        "launched by `dagster-daemon run` as one run (the asset's single-run backfill policy) ..."
    )
    t0_shards = time.monotonic()
    with tempfile.TemporaryFile("w+") as output:
        daemon = subprocess.Popen(
            [DAEMON, "run", "-w", "workspace.yaml"],
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # the daemon and its code server: one group to stop
        )
        try:
            runs = _wait_for_backfill(instance, backfill_id, args.timeout, daemon, output)
        finally:
            _stop(daemon)
    failed = [r for r in runs if r.status != dg.DagsterRunStatus.SUCCESS]
    _say(f"2/3 shards: all finished in {time.monotonic() - t0_shards:.1f} s")
    _in_process("3/3 summary", instance, "routing_summary")
    elapsed = time.monotonic() - t0

    # Each shard's materialization reports its own rows: one row per run, the sum of its shards.
    keys = SHARDS.get_partition_keys()
    counts = ("rows_total", "rows_computed", "rows_resumed", "rows_failed")
    by_run: dict[str, list[str]] = {}
    sums: dict[str, dict[str, int]] = {}
    for key in keys:
        found = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=ASSET, asset_partitions=[key]), limit=1
        ).records
        event = found[0].asset_materialization if found else None
        if event is None or found[0].run_id not in {r.run_id for r in runs}:
            continue  # the shard did not materialize in this backfill
        by_run.setdefault(found[0].run_id, []).append(key)
        run_sums = sums.setdefault(found[0].run_id, dict.fromkeys(counts, 0))
        for k in counts:
            value = event.metadata.get(k)
            if isinstance(value, dg.IntMetadataValue):
                run_sums[k] += value.value or 0
    table = pl.DataFrame(
        [
            {
                "run": run_id[:8],
                "shards": f"{shards[0]} to {shards[-1]}" if len(shards) > 1 else shards[0],
                **sums[run_id],
            }
            for run_id, shards in by_run.items()
        ],
        schema={"run": pl.String, "shards": pl.String, **dict.fromkeys(counts, pl.Int64)},
    )
    with pl.Config(tbl_rows=20, tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        print(table)
    totals = table.select(counts).sum().row(0, named=True)
    done = sum(len(shards) for shards in by_run.values())
    print(
        f"{len(runs)} run(s) ({len(failed)} failed), {done} of {len(keys)} shards materialized, "
        f"in {elapsed:.1f} s: {totals['rows_total']:,} tickets, {totals['rows_computed']:,} "
        f"computed now, {totals['rows_resumed']:,} resumed from checkpoints, "
        f"{totals['rows_failed']:,} failed."
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
