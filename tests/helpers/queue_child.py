"""Child process of the shared-queue test: one shard's run of a provider batch asset through
OpenAI's Batch API, materialized by Dagster, its resource stating the queue's limit.

Usage: ``python queue_child.py BASE_URL BASE_DIR ROWS PARTITION ENQUEUED_TOKENS``. Prints one
JSON line: whether the run succeeded, the rows its checkpoint holds and those failed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import dagster as dg
import polars as pl

from checkpoint_assets import (
    CheckpointIOManager,
    OpenAIResource,
    provider_batch_asset,
    shard_partitions,
)
from checkpoint_assets.engine import Checkpoint, open_store

TEXTS = ("I was charged twice, please refund me", "The app crashes with an error", "hello")


def main(url: str, base_dir: str, rows: int, partition: str, enqueued_tokens: int) -> None:
    df = pl.DataFrame({"ticket_id": list(range(rows)), "body": [TEXTS[i % 3] for i in range(rows)]})

    @dg.asset(name="tickets", io_manager_key="source_io")
    def tickets() -> pl.DataFrame:
        return df

    def parse(body: dict[str, Any]) -> dict[str, Any]:
        return {"answer": body["choices"][0]["message"]["content"]}

    @provider_batch_asset(
        name="routed",
        source="tickets",
        id_column="ticket_id",
        input_columns=["body"],
        parse=parse,
        partitions_def=shard_partitions(2),
        poll_seconds=0.1,
        max_poll_seconds=0.5,
    )
    def routed(row: dict[str, Any]) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": row["body"]}]}

    resource = OpenAIResource(
        base_url=url, api_key="local", model="m", enqueued_tokens=enqueued_tokens
    )
    result = dg.materialize(
        [tickets, routed],
        instance=dg.DagsterInstance.ephemeral(),
        resources={
            "io_manager": CheckpointIOManager(base_dir=base_dir),
            "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
            "openai": resource,
        },
        partition_key=partition,
        raise_on_error=False,
    )
    stored = Checkpoint(open_store(base_dir), f"routed/default/{partition}").load("ticket_id").rows
    failed = stored.height - stored.get_column("_error").null_count()
    print(json.dumps({"success": result.success, "rows": stored.height, "failed": failed}))


if __name__ == "__main__":
    url, base_dir, rows, partition, tokens = sys.argv[1:6]
    main(url, base_dir, int(rows), partition, int(tokens))
