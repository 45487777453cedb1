"""Definitions for the orphaned-step tests (``tests/reliability/test_orphans.py``), run with
`dagster asset materialize -f` against ``$DAGSTER_HOME`` (checkpoints under
``$DAGSTER_HOME/checkpoints``). Steps run in their own process (the default executor), a child
of the `dagster asset materialize` that launched them.

- ``rows``: the source, read from the Parquet file ``$ORPHAN_SOURCE``.
- ``slow``: two shards, one row per call, two calls in flight, a flush every 4 rows. Each call
  appends its id to ``$ORPHAN_CALLS/<pid>.txt`` as it starts (the rows paid for), then sleeps
  ``$ORPHAN_SECONDS_PER_CALL``.
"""

from __future__ import annotations

import os
import time

import dagster as dg
import polars as pl

from checkpoint_assets import CheckpointIOManager, checkpointed_asset, shard_partitions


@dg.asset
def rows() -> pl.DataFrame:
    return pl.read_parquet(os.environ["ORPHAN_SOURCE"])


@checkpointed_asset(
    source="rows",
    id_column="ticket_id",
    partitions_def=shard_partitions(2),
    checkpoint_interval=4,
    batch_size=1,
    max_concurrency=2,
)
def slow(batch: pl.DataFrame) -> pl.DataFrame:
    calls = os.path.join(os.environ["ORPHAN_CALLS"], f"{os.getpid()}.txt")
    with open(calls, "a") as f:
        f.writelines(f"{i}\n" for i in batch.get_column("ticket_id"))
    time.sleep(float(os.environ.get("ORPHAN_SECONDS_PER_CALL", "0.05")))
    return batch.select("ticket_id", score=pl.col("body").str.len_chars())


defs = dg.Definitions(assets=[rows, slow], resources={"io_manager": CheckpointIOManager()})
