"""The support tickets of ``examples.llm_openai``, classified through Anthropic's Messages API.

The same tickets, prompt, shards and settings (``ticket_department_asset``), through the
``anthropic`` package: the client comes from ``checkpoint_assets.AnthropicResource`` (one
``AsyncAnthropic`` per event loop, ``max_retries=0``), so a ``429`` (``RateLimitError``) or a
``529`` (``OverloadedError``) pauses the shard instead of failing rows, and the tokens of every
answer are summed into the materialization's metadata. The endpoint comes from
``ANTHROPIC_BASE_URL`` (unset: Anthropic's API), the key from ``ANTHROPIC_API_KEY``; the local
server of ``examples.llm_openai`` speaks this API too::

    python -m examples.llm_openai.server --port 8010 &
    export ANTHROPIC_BASE_URL=http://127.0.0.1:8010 ANTHROPIC_API_KEY=local   # no /v1
    export DAGSTER_HOME=$PWD/dagster_home
    dagster asset materialize -m examples.llm_anthropic.definitions --select llm_tickets
    dagster asset materialize -m examples.llm_anthropic.definitions \\
        --select ticket_department_anthropic --partition 0-of-4

Tunable through the environment: ``LLM_TICKETS`` (rows, default 2000), ``ANTHROPIC_MODEL``
(default ``claude-haiku-4-5``), ``LLM_MAX_CONCURRENCY`` (default 32) and
``CHECKPOINT_BASE_DIR`` (default: ``$DAGSTER_HOME/checkpoints``).
"""

from __future__ import annotations

import os

import dagster as dg
import polars as pl

from checkpoint_assets import (
    AnthropicResource,
    CheckpointIOManager,
    failed_partitions_sensor,
)
from examples.llm_openai.definitions import (
    SYSTEM,
    llm_tickets,
    ticket_department_asset,
)


@ticket_department_asset(
    usage_columns=["input_tokens", "output_tokens"], group_name="llm_anthropic"
)
async def ticket_department_anthropic(
    batch: pl.DataFrame, claude: AnthropicResource
) -> pl.DataFrame:
    """The department of each ticket, as Claude answers it, with the tokens it used."""
    (ticket,) = batch.iter_rows(named=True)  # batch_size=1: one prompt per call
    reply = await claude.client().messages.create(
        system=SYSTEM,
        messages=[{"role": "user", "content": f"{ticket['subject']}\n\n{ticket['body']}"}],
        **claude.request_defaults(),  # model and max_tokens
    )
    text = "".join(block.text for block in reply.content if block.type == "text")
    return pl.DataFrame(
        {
            "ticket_id": [ticket["ticket_id"]],
            "department": [text.strip().lower()],
            "input_tokens": [reply.usage.input_tokens],
            "output_tokens": [reply.usage.output_tokens],
        }
    )


defs = dg.Definitions(
    assets=[llm_tickets, ticket_department_anthropic],
    sensors=[failed_partitions_sensor(ticket_department_anthropic, max_retries=3)],
    resources={
        "io_manager": CheckpointIOManager(base_dir=os.environ.get("CHECKPOINT_BASE_DIR")),
        # No base_url: the anthropic client reads ANTHROPIC_BASE_URL, or calls Anthropic's API.
        "claude": AnthropicResource(
            api_key=dg.EnvVar("ANTHROPIC_API_KEY"),
            model=os.environ.get("ANTHROPIC_MODEL", "claude-haiku-4-5"),
            max_tokens=8,  # a department name
        ),
    },
    # A run's steps run in the run's own process: no process start per step.
    executor=dg.in_process_executor,
)
