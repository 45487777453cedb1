"""Support tickets classified by a chat model through the providers' batch APIs, checkpointed:
half the price of per-row calls, results within the provider's window instead of at once.

Two assets over the tickets (``llm_tickets``), prompt and shards of ``examples.llm_openai``, one
per provider (``department_asset`` holds what they share): ``ticket_department_openai`` (OpenAI's
Batch API through ``OpenAIResource``) and ``ticket_department_claude`` (Anthropic's Message
Batches through ``AnthropicResource``). Each writes the request of one row (``request``) and reads
the answer of one row (``parse_*``, with the tokens as usage columns); the package splits each
shard's rows into submissions, records them in the shard's checkpoint before sending anything,
and stores the results like computed rows. Both submit and end (``wait=False``): the run ends
"Submitted, not materialized yet" in seconds, and ``provider_batches_sensor`` requests the run
that collects a shard once its batches have ended. Launch with ``wait: true`` in run config to
wait in the run instead.

The endpoints and keys come from the environment, so the same code runs against the real
providers or the local one in ``provider.py``::

    python -m examples.llm_batch.provider --port 8020 --processing-delay 30 &
    export OPENAI_BASE_URL=http://127.0.0.1:8020/v1 OPENAI_API_KEY=local
    export ANTHROPIC_BASE_URL=http://127.0.0.1:8020 ANTHROPIC_API_KEY=local
    export DAGSTER_HOME=$PWD/dagster_home
    dagster asset materialize -m examples.llm_batch.definitions --select llm_tickets
    dagster asset materialize -m examples.llm_batch.definitions \\
        --select ticket_department_openai --partition 0-of-4      # submits, ends at once
    dagster dev -m examples.llm_batch.definitions                 # the sensor collects

Tunable through the environment: ``LLM_TICKETS`` (rows, default 2000), ``OPENAI_MODEL``
(default ``gpt-4o-mini``), ``ANTHROPIC_MODEL`` (default ``claude-haiku-4-5``) and
``CHECKPOINT_BASE_DIR`` (default: ``$DAGSTER_HOME/checkpoints``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import dagster as dg

from checkpoint_assets import (
    AnthropicResource,
    CheckpointIOManager,
    OpenAIResource,
    provider_batch_asset,
    provider_batches_sensor,
)
from examples.llm_openai.definitions import SHARDS, SYSTEM, llm_tickets


def parse_openai(body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's department and tokens."""
    usage = body.get("usage") or {}
    return {
        "department": body["choices"][0]["message"]["content"].strip().lower(),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
    }


def parse_claude(body: dict[str, Any]) -> dict[str, Any]:
    """A message's department and tokens."""
    usage = body.get("usage") or {}
    return {
        "department": body["content"][0]["text"].strip().lower(),
        "prompt_tokens": usage.get("input_tokens", 0),
        "completion_tokens": usage.get("output_tokens", 0),
    }


def prompt(row: dict[str, Any]) -> str:
    return f"{row['subject']}\n\n{row['body']}"


# What the two assets share: the tickets' department, submitted and left to the sensor. Each
# adds its provider's resource and how to read its answer.
department_asset = functools.partial(
    provider_batch_asset,
    source=llm_tickets,
    id_column="ticket_id",
    input_columns=["subject", "body"],
    wait=False,
    poll_seconds=10,
    partitions_def=SHARDS,
    usage_columns=["prompt_tokens", "completion_tokens"],
    code_version="department-v1",
    group_name="llm_batch",
)


@department_asset(provider="openai_chat", parse=parse_openai)
def ticket_department_openai(row: dict[str, Any]) -> dict[str, Any]:
    """The department of each ticket, as OpenAI's Batch API answers it."""
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": prompt(row)},
        ]
    }


@department_asset(provider="claude", parse=parse_claude)
def ticket_department_claude(row: dict[str, Any]) -> dict[str, Any]:
    """The department of each ticket, as Anthropic's Message Batches answer it."""
    return {"system": SYSTEM, "messages": [{"role": "user", "content": prompt(row)}]}


_HOME = os.environ.get("DAGSTER_HOME", ".")
defs = dg.Definitions(
    assets=[llm_tickets, ticket_department_openai, ticket_department_claude],
    sensors=[
        provider_batches_sensor(ticket_department_openai),
        provider_batches_sensor(ticket_department_claude),
    ],
    resources={
        "openai_chat": OpenAIResource(
            base_url=os.environ.get("OPENAI_BASE_URL"),
            api_key=dg.EnvVar("OPENAI_API_KEY"),
            model=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"),
        ),
        "claude": AnthropicResource(
            base_url=os.environ.get("ANTHROPIC_BASE_URL"),
            api_key=dg.EnvVar("ANTHROPIC_API_KEY"),
            model=os.environ.get("ANTHROPIC_MODEL", "claude-haiku-4-5"),
            max_tokens=16,
        ),
        "io_manager": CheckpointIOManager(
            base_dir=os.environ.get("CHECKPOINT_BASE_DIR", os.path.join(_HOME, "checkpoints"))
        ),
    },
    # A run's steps run in the run's own process: no process start per step.
    executor=dg.in_process_executor,
)
