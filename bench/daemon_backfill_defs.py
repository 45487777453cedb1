"""The code location of ``bench/daemon_backfill.py``: a source of ``ROWS`` rows and a checkpointed
asset over ``SHARDS`` shards, run by backfills in ranged runs of ``PER_RUN`` shards.

Sizes come from the environment (``BENCH_SHARDS``, ``BENCH_PER_RUN``, ``BENCH_ROWS``) so that the
daemon's code server and its runs load the same definitions as the script.
"""

import os

import dagster as dg
import polars as pl

from checkpoint_assets import CheckpointIOManager, checkpointed_asset, shard_partitions

SHARDS = int(os.environ.get("BENCH_SHARDS", "1024"))
PER_RUN = int(os.environ.get("BENCH_PER_RUN", "64"))
ROWS = int(os.environ.get("BENCH_ROWS", str(20 * SHARDS)))


@dg.asset(name="tickets")
def tickets() -> pl.DataFrame:
    return pl.DataFrame({"ticket_id": range(ROWS), "body": [f"b{i}" for i in range(ROWS)]})


@checkpointed_asset(
    source="tickets",
    id_column="ticket_id",
    partitions_def=shard_partitions(SHARDS),
    backfill_policy=dg.BackfillPolicy.multi_run(PER_RUN),
    checkpoint_interval=64,
)
def scored(batch: pl.DataFrame) -> pl.DataFrame:
    return batch.select("ticket_id", score=pl.col("body").str.len_bytes())


defs = dg.Definitions(
    assets=[tickets, scored],
    resources={"io_manager": CheckpointIOManager()},
    executor=dg.in_process_executor,
)
