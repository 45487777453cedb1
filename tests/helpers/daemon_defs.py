"""Definitions for the daemon-path tests (``tests/e2e/test_daemon_path.py``), served by
`dagster dev` through a workspace file (module ``helpers.daemon_defs``, the tests folder as
working directory). Checkpoints go under ``$DAGSTER_HOME/checkpoints``.

- ``rows``: the source, read from the Parquet file ``$DAEMON_SOURCE`` (the test grows it).
- ``sharded`` and ``stopped``: two shards each, 4 rows per call and flush.
- ``growing``: unpartitioned, materialized with ``rows`` by ``growing_job``, which
  ``growing_schedule`` runs every minute.

Each call sleeps ``$DAEMON_SECONDS_PER_CALL`` (like a remote model) and appends the ids it
computed to ``$DAEMON_CALLS/<asset>-<pid>.txt``, so the test counts every row computed. A run
of ``sharded``, once its first batch is flushed, waits for the file ``$DAEMON_CALLS/go``: the
test creates it once both shards wait there, so they are mid-run at the same time whatever the
machine's load. Runs execute in process (one process per run).
"""

from __future__ import annotations

import os
import time

import dagster as dg
import polars as pl

from checkpoint_assets import CheckpointIOManager, checkpointed_asset, shard_partitions

SHARDS = shard_partitions(2)
INTERVAL = 4


@dg.asset
def rows() -> pl.DataFrame:
    return pl.read_parquet(os.environ["DAEMON_SOURCE"])


def _score(asset: str, batch: pl.DataFrame) -> pl.DataFrame:
    time.sleep(float(os.environ.get("DAEMON_SECONDS_PER_CALL", "0")))
    calls = os.path.join(os.environ["DAEMON_CALLS"], f"{asset}-{os.getpid()}.txt")
    with open(calls, "a") as f:
        f.writelines(f"{i}\n" for i in batch.get_column("ticket_id"))
    return batch.select("ticket_id", score=pl.col("body").str.len_chars())


_calls_in_this_run = 0


@checkpointed_asset(
    source="rows", id_column="ticket_id", partitions_def=SHARDS, checkpoint_interval=INTERVAL
)
def sharded(batch: pl.DataFrame) -> pl.DataFrame:
    global _calls_in_this_run
    _calls_in_this_run += 1
    if _calls_in_this_run == 2:  # the first batch is flushed
        go = os.path.join(os.environ["DAEMON_CALLS"], "go")
        deadline = time.monotonic() + 180
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.1)
    return _score("sharded", batch)


@checkpointed_asset(
    source="rows", id_column="ticket_id", partitions_def=SHARDS, checkpoint_interval=INTERVAL
)
def stopped(batch: pl.DataFrame) -> pl.DataFrame:
    return _score("stopped", batch)


@checkpointed_asset(source="rows", id_column="ticket_id", checkpoint_interval=INTERVAL)
def growing(batch: pl.DataFrame) -> pl.DataFrame:
    return _score("growing", batch)


growing_job = dg.define_asset_job("growing_job", selection=[rows, growing])
growing_schedule = dg.ScheduleDefinition(
    name="growing_schedule", job=growing_job, cron_schedule="* * * * *"
)

defs = dg.Definitions(
    assets=[rows, sharded, stopped, growing],
    jobs=[growing_job],
    schedules=[growing_schedule],
    executor=dg.in_process_executor,
    resources={"io_manager": CheckpointIOManager()},
)
