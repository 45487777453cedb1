"""Support tickets classified by a chat model through the ``openai`` package, checkpointed.

One prompt per call (``batch_size=1``), up to 32 in flight per shard (``max_concurrency``), a
flush every 64 answers (``checkpoint_interval``), the tokens of every answer summed into the
materialization's metadata (``usage_columns``), rate limits honoured shard-wide (the client's
``RateLimitError`` carries ``Retry-After``), and the failed-partitions sensor re-running a shard
that stopped. The client comes from ``checkpoint_assets.OpenAIResource``: one ``AsyncOpenAI`` per
event loop, ``max_retries=0`` so every rate limit reaches the shard. ``examples.llm_anthropic``
is the same asset through Anthropic's API. The endpoint and key come from the environment, so
the same code runs against the OpenAI API, vLLM, Ollama, LiteLLM or the local server in
``server.py``::

    python -m examples.llm_openai.server --port 8010 &          # or any OpenAI-compatible URL
    export OPENAI_BASE_URL=http://127.0.0.1:8010/v1 OPENAI_API_KEY=local
    export DAGSTER_HOME=$PWD/dagster_home
    dagster asset materialize -m examples.llm_openai.definitions --select llm_tickets
    dagster asset materialize -m examples.llm_openai.definitions \\
        --select ticket_department --partition 0-of-4

Tunable through the environment: ``LLM_TICKETS`` (rows, default 2000), ``OPENAI_MODEL``
(default ``gpt-4o-mini``), ``LLM_MAX_CONCURRENCY`` (default 32) and ``CHECKPOINT_BASE_DIR``
(default: ``$DAGSTER_HOME/checkpoints``).
"""

from __future__ import annotations

import functools
import os

import dagster as dg
import polars as pl

from checkpoint_assets import (
    CheckpointIOManager,
    OpenAIResource,
    checkpointed_asset,
    failed_partitions_sensor,
    shard_partitions,
)
from examples.ticket_routing.data import generate_tickets

SHARDS = shard_partitions(4)
DEPARTMENTS = ("billing", "technical", "account", "shipping", "sales", "other")
SYSTEM = (
    f"Route the support ticket to one department: {', '.join(DEPARTMENTS)}. Answer with the "
    "department only."
)


# Its own key, not the demo's ``tickets``: the examples share one ``DAGSTER_HOME`` and checkpoints.
@dg.asset(group_name="llm_openai", kinds={"polars"})
def llm_tickets() -> pl.DataFrame:
    """Support tickets to classify (generated deterministically)."""
    return generate_tickets(int(os.environ.get("LLM_TICKETS", "2000")))


# The asset's arguments that this example and ``examples.llm_anthropic`` share: the tickets'
# department, one prompt per call, 32 in flight, a flush every 64 answers. Each adds its own
# token columns and group.
ticket_department_asset = functools.partial(
    checkpointed_asset,
    source=llm_tickets,
    id_column="ticket_id",
    input_columns=["subject", "body"],
    partitions_def=SHARDS,
    batch_size=1,
    checkpoint_interval=64,
    max_concurrency=int(os.environ.get("LLM_MAX_CONCURRENCY", "32")),
    retry_delay_seconds=0.5,  # also the first back-off of a 429/529 that says no Retry-After
    code_version="department-v1",
    pool="llm",
)


@ticket_department_asset(
    usage_columns=["prompt_tokens", "completion_tokens"], group_name="llm_openai"
)
async def ticket_department(batch: pl.DataFrame, openai_chat: OpenAIResource) -> pl.DataFrame:
    """The department of each ticket, as the chat model answers it, with the tokens it used."""
    (ticket,) = batch.iter_rows(named=True)  # batch_size=1: one prompt per call
    reply = await openai_chat.client().chat.completions.create(
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{ticket['subject']}\n\n{ticket['body']}"},
        ],
        **openai_chat.request_defaults(),  # the model, and temperature / max_tokens if set
    )
    usage = reply.usage
    return pl.DataFrame(
        {
            "ticket_id": [ticket["ticket_id"]],
            "department": [(reply.choices[0].message.content or "").strip().lower()],
            "prompt_tokens": [usage.prompt_tokens if usage else 0],
            "completion_tokens": [usage.completion_tokens if usage else 0],
        }
    )


defs = dg.Definitions(
    assets=[llm_tickets, ticket_department],
    sensors=[failed_partitions_sensor(ticket_department, max_retries=3)],
    resources={
        "io_manager": CheckpointIOManager(base_dir=os.environ.get("CHECKPOINT_BASE_DIR")),
        "openai_chat": OpenAIResource(
            base_url=dg.EnvVar("OPENAI_BASE_URL"),
            api_key=dg.EnvVar("OPENAI_API_KEY"),
            model=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"),
        ),
    },
    # A run's steps run in the run's own process: no process start per step.
    executor=dg.in_process_executor,
)
