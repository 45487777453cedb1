"""The ticket-routing demo: 100,000 support tickets routed by an imitation model, in 8 shards.

``tickets`` generates the input deterministically; ``ticket_routing`` calls the imitation model
(latency, occasional transient 503s, all seeded) through ``checkpointed_asset``;
``routing_summary`` reads every shard back as one table. ``ticket_routing_global_resume``, the
failed-partition sensor and the completeness and failed-row checks complete the picture.

Tunable through the environment, so the same definitions serve the demo, tests and benchmarks:
``DEMO_TICKETS`` (rows, default 100000), ``DEMO_LATENCY_MS`` (per call, default 2),
``DEMO_ERROR_RATE`` (transient error probability per call, default 0.02), ``DEMO_SHARDS``
(default 8), ``DEMO_RUN_PER_SHARD`` (``1``: a backfill starts one run per shard, as the
deployments in ``deploy/`` want; default: one run for all) and ``CHECKPOINT_BASE_DIR``
(default: ``$DAGSTER_HOME/checkpoints``). Either way a run's steps run in the run's process.
"""

from __future__ import annotations

import os

import dagster as dg
import polars as pl

from checkpoint_assets import (
    CheckpointIOManager,
    checkpoint_checks,
    checkpointed_asset,
    failed_partitions_sensor,
    global_resume_asset,
    shard_partitions,
)
from examples.ticket_routing.data import generate_tickets
from examples.ticket_routing.model import FakeRouter

SHARDS = shard_partitions(int(os.environ.get("DEMO_SHARDS", "8")))
RUN_PER_SHARD = os.environ.get("DEMO_RUN_PER_SHARD") == "1"
router = FakeRouter(
    latency_ms=float(os.environ.get("DEMO_LATENCY_MS", "2")),
    transient_error_rate=float(os.environ.get("DEMO_ERROR_RATE", "0.02")),
    seed=11,
)


@dg.asset(group_name="ticket_routing", kinds={"polars"})
def tickets() -> pl.DataFrame:
    """Support tickets to route (generated deterministically)."""
    return generate_tickets(int(os.environ.get("DEMO_TICKETS", "100000")))


@checkpointed_asset(
    source=tickets,
    id_column="ticket_id",
    input_columns=["subject", "body", "customer_tier"],
    partitions_def=SHARDS,
    checkpoint_interval=64,
    retry_delay_seconds=0.05,
    code_version="router-v1",
    pool="model_endpoint",
    group_name="ticket_routing",
    # A backfill of many small shards is one run that walks them in turn: one run's start-up,
    # not one per shard. Dagster's default (None) starts a run per shard, for shards that scale
    # out or take hours.
    backfill_policy=None if RUN_PER_SHARD else dg.BackfillPolicy.single_run(),
)
def ticket_routing(batch: pl.DataFrame) -> pl.DataFrame:
    """Department, priority and confidence of each ticket, from the (imitation) routing model."""
    return router.route(batch)


@dg.asset(group_name="ticket_routing", kinds={"polars"})
def routing_summary(ticket_routing: pl.DataFrame) -> pl.DataFrame:
    """Tickets per department and priority, over every shard."""
    return (
        ticket_routing.filter(pl.col("_error").is_null())
        .group_by("department", "priority")
        .len("tickets")
        .sort("department", "priority")
    )


# One run per shard, as `dagster job backfill -j ticket_routing_job` launches (a job backfill does
# not follow the asset's backfill policy).
ticket_routing_job = dg.define_asset_job(
    "ticket_routing_job", selection=[ticket_routing], partitions_def=SHARDS
)

defs = dg.Definitions(
    assets=[tickets, ticket_routing, routing_summary, global_resume_asset(ticket_routing)],
    asset_checks=checkpoint_checks(ticket_routing),
    jobs=[ticket_routing_job],
    sensors=[failed_partitions_sensor(ticket_routing, max_retries=3, backoff_seconds=30)],
    resources={"io_manager": CheckpointIOManager(base_dir=os.environ.get("CHECKPOINT_BASE_DIR"))},
    # A run's steps (its shards, then the checks) run in the run's own process: one process
    # start per run, not one more per step as with Dagster's default executor (about 3 CPU
    # seconds each). A shard's step waits on its endpoint; more processes would not speed it.
    executor=dg.in_process_executor,
)
