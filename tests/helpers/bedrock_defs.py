"""A request/parse asset through Amazon Bedrock (``BedrockResource``) against the fake of
``bedrock_fake.py`` and S3 on moto's server, for the Bedrock tests and their killed children."""

from __future__ import annotations

from typing import Any

import dagster as dg
import polars as pl

from checkpoint_assets import CheckpointIOManager, provider_batch_asset, shard_partitions
from checkpoint_assets.resources.bedrock import BedrockResource

ASSET = "routed"
ID = "ticket_id"
MODEL = "anthropic.claude-3-5-haiku-20241022-v1:0"
ROLE = "arn:aws:iam::123456789012:role/bedrock-batch"


def text(i: int) -> str:
    """Row ``i``'s text: unique, so the fake counts requests by row."""
    return f"ticket {i}"


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


def parse(message: dict[str, Any]) -> dict[str, Any]:
    return {
        "answer": message["content"][0]["text"],
        "input_tokens": message["usage"]["input_tokens"],
    }


def resource(fake_url: str, s3_endpoint: str, bucket: str, **kw: Any) -> BedrockResource:
    return BedrockResource(
        region="us-east-1",
        model_id=MODEL,
        max_tokens=16,
        batch_role_arn=ROLE,
        input_prefix=f"s3://{bucket}/bedrock/input/",
        output_prefix=f"s3://{bucket}/bedrock/output/",
        endpoint_urls={"bedrock": fake_url, "bedrock-runtime": fake_url, "s3": s3_endpoint},
        **kw,
    )


def assets(rows: int, shards: int = 4, **kw: Any) -> list[dg.AssetsDefinition]:
    """The source of ``rows`` tickets and the asset routing them through Bedrock in ``shards``
    shards; ``kw`` overrides the asset's arguments."""

    @dg.asset(name="tickets", io_manager_key="source_io")
    def tickets() -> pl.DataFrame:
        return pl.DataFrame({ID: list(range(rows)), "body": [text(i) for i in range(rows)]})

    options: dict[str, Any] = {
        "source": "tickets",
        "id_column": ID,
        "parse": parse,
        "provider": "bedrock",
        "input_columns": ["body"],
        "partitions_def": shard_partitions(shards),
        "usage_columns": ["input_tokens"],
        "poll_seconds": 0.05,
        "max_poll_seconds": 0.2,
    }

    @provider_batch_asset(name=ASSET, **(options | kw))
    def routed(row: dict[str, Any]) -> dict[str, Any]:
        return request(row)

    return [tickets, routed]


def resources(base_dir: str, bedrock: BedrockResource) -> dict[str, Any]:
    return {
        "io_manager": CheckpointIOManager(base_dir=base_dir),
        "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
        "bedrock": bedrock,
    }
