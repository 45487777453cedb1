"""Definitions for the daemon and job backfill tests: a sharded asset with a poison row in one
shard, its job (for ``dagster job backfill``), and a ``failed_partitions_sensor`` that is on from
the start.

Loaded by ``dagster-daemon`` through a workspace file (module ``helpers.sensor_defs`` with the
tests folder as working directory); checkpoints go under ``$DAGSTER_HOME/checkpoints``.
"""

from __future__ import annotations

import dagster as dg
import polars as pl

from checkpoint_assets import (
    CheckpointIOManager,
    checkpointed_asset,
    failed_partitions_sensor,
    shard_partitions,
)
from checkpoint_assets.engine.sharding.hashing import shard_of

SHARDS = shard_partitions(2)
FAILING = "1-of-2"
ROWS = pl.DataFrame({"ticket_id": range(20), "body": [f"b{i}" for i in range(20)]})
POISON = int(ROWS.get_column("ticket_id").filter(pl.Series(shard_of(ROWS["ticket_id"], 2) == 1))[0])


@dg.asset
def tickets() -> pl.DataFrame:
    return ROWS


@checkpointed_asset(
    source="tickets",
    id_column="ticket_id",
    partitions_def=SHARDS,
    checkpoint_interval=4,
    retry_delay_seconds=0,
)
def scored(batch: pl.DataFrame) -> pl.DataFrame:
    if POISON in batch.get_column("ticket_id").to_list():
        raise ValueError(f"ticket {POISON} cannot be scored")
    return batch.select("ticket_id", score=pl.col("body").str.len_chars())


scored_job = dg.define_asset_job("scored_job", selection=[scored], partitions_def=SHARDS)
retries = failed_partitions_sensor(
    scored,
    max_retries=2,
    backoff_seconds=0,
    minimum_interval_seconds=1,
    default_status=dg.DefaultSensorStatus.RUNNING,
)
# Each run's steps in the run's own process: the tests watch the runs the daemon launches, not
# how a run spreads its steps over processes (a process more per step would only cost time).
defs = dg.Definitions(
    assets=[tickets, scored],
    jobs=[scored_job],
    sensors=[retries],
    resources={"io_manager": CheckpointIOManager()},
    executor=dg.in_process_executor,
)
