"""The definitions ``bench.shared_key`` materializes, one ``dagster`` process per shard.

The OpenAI example's asset (one ticket per call, 32 in flight) over ``SHARED_KEY_SHARDS`` shards,
calling ``OPENAI_BASE_URL``. ``SHARED_KEY_TOKENS_PER_MINUTE`` and
``SHARED_KEY_REQUESTS_PER_MINUTE`` set the resource's limits for a server that states none; the
shards count each other as they start and finish (``shards_at_once`` unset). Each shard's first
call waits until every shard's process is ready (a file each in ``SHARED_KEY_READY_DIR``).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import dagster as dg
import polars as pl

from checkpoint_assets import (
    CheckpointIOManager,
    OpenAIResource,
    checkpointed_asset,
    shard_partitions,
)
from examples.llm_openai.definitions import SYSTEM
from examples.ticket_routing.data import generate_tickets

SHARDS = int(os.environ.get("SHARED_KEY_SHARDS", "4"))


def _limit(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


_READY = {"done": False}


async def _all_ready() -> None:
    """Wait until every shard's process is ready to call, so the shards start at once (on a
    busy machine their processes take seconds apart to start)."""
    if _READY["done"]:
        return
    folder = Path(os.environ["SHARED_KEY_READY_DIR"])
    (folder / str(os.getpid())).touch()
    while len(list(folder.iterdir())) < SHARDS:
        await asyncio.sleep(0.01)
    _READY["done"] = True


@dg.asset
def shared_key_tickets() -> pl.DataFrame:
    """The tickets every shard classifies (generated deterministically)."""
    return generate_tickets(int(os.environ.get("SHARED_KEY_TICKETS", "2000")))


@checkpointed_asset(
    source=shared_key_tickets,
    id_column="ticket_id",
    input_columns=["subject", "body"],
    partitions_def=shard_partitions(SHARDS),
    batch_size=1,
    checkpoint_interval=64,
    max_concurrency=32,
    retry_delay_seconds=0.5,
)
async def shared_key_department(batch: pl.DataFrame, openai_chat: OpenAIResource) -> pl.DataFrame:
    """The department of each ticket, as the chat server answers it."""
    await _all_ready()
    (ticket,) = batch.iter_rows(named=True)
    reply = await openai_chat.client().chat.completions.create(
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{ticket['subject']}\n\n{ticket['body']}"},
        ],
        **openai_chat.request_defaults(),
    )
    department = (reply.choices[0].message.content or "").strip()
    return pl.DataFrame({"ticket_id": [ticket["ticket_id"]], "department": [department]})


defs = dg.Definitions(
    assets=[shared_key_tickets, shared_key_department],
    resources={
        "io_manager": CheckpointIOManager(base_dir=os.environ["CHECKPOINT_BASE_DIR"]),
        "openai_chat": OpenAIResource(
            base_url=os.environ["OPENAI_BASE_URL"],
            api_key="bench",
            model="ticket-router-1",
            max_tokens=8,
            requests_per_minute=_limit("SHARED_KEY_REQUESTS_PER_MINUTE"),
            tokens_per_minute=_limit("SHARED_KEY_TOKENS_PER_MINUTE"),
        ),
    },
)
