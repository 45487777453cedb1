"""The assets and runs of the estimate's tests (``tests/integration/test_estimate.py``) and of
``bench/estimate.py``. Also definitions for ``checkpoint-assets estimate -f``
(``tests/e2e/test_cli_estimate.py``): the texts stored by the IO manager under ``$DAGSTER_HOME``,
the chat server at ``OPENAI_BASE_URL``.

The texts are words of three letters: four bytes a word with its space, so bytes/4 meets the
local servers' count of a token per word (see the tests' docstring).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl

from checkpoint_assets import (
    Budget,
    CheckpointIOManager,
    OpenAIResource,
    Price,
    checkpointed_asset,
    provider_batch_asset,
    shard_partitions,
)
from checkpoint_assets.engine.plan.estimate import Estimate
from checkpoint_assets.integration import metadata as md

ID = "id"
ASSET = "routed"
SHARDS = shard_partitions(2)
PRICE = Price(input=1.0, output=2.0)
BUDGET = Budget({"m": PRICE}, input_tokens="prompt_tokens", output_tokens="completion_tokens")
SYSTEM = "Route the support ticket to one department."
ROWS = 120


def texts(n: int, seed: int = 7) -> pl.DataFrame:
    """``n`` rows of 20 to 60 words of three letters each."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def word() -> str:
        return "".join(rng.choice(letters) for _ in range(3))

    bodies = [" ".join(word() for _ in range(rng.randint(20, 60))) for _ in range(n)]
    return pl.DataFrame({ID: list(range(n)), "text": bodies})


def parse(body: dict[str, Any]) -> dict[str, Any]:
    usage = body["usage"]
    return {
        "department": body["choices"][0]["message"]["content"],
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
    }


def online_asset(**kw: Any) -> dg.AssetsDefinition:
    @checkpointed_asset(
        **kw,
        source="texts",
        name=ASSET,
        id_column=ID,
        input_columns=["text"],
        partitions_def=SHARDS,
        usage_columns=["prompt_tokens", "completion_tokens"],
        budget=BUDGET,
        checkpoint_interval=16,
        retry_delay_seconds=0.0,
    )
    async def routed(row: dict[str, Any], chat: OpenAIResource) -> dict[str, Any]:
        reply = await chat.client().chat.completions.create(
            messages=[{"role": "user", "content": row["text"]}], **chat.request_defaults()
        )
        return parse(reply.model_dump())

    return routed


def batch_asset(**kw: Any) -> dg.AssetsDefinition:
    @provider_batch_asset(
        **{"parse": parse, **kw},
        source="texts",
        name=ASSET,
        id_column=ID,
        input_columns=["text"],
        partitions_def=SHARDS,
        usage_columns=["prompt_tokens", "completion_tokens"],
        budget=BUDGET,
        provider="chat",
        poll_seconds=0.05,
        max_poll_seconds=0.2,
    )
    def routed(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": row["text"]},
            ]
        }

    return routed


class Job:
    """One asset over ``texts(ROWS)`` on a real SQLite instance and checkpoint files."""

    def __init__(self, tmp_path: Path, url: str, asset: dg.AssetsDefinition) -> None:
        self.base_dir = tmp_path / "checkpoints"
        self.instance = dg.DagsterInstance.local_temp(
            tempdir=str(tmp_path), overrides={"telemetry": {"enabled": False}}
        )
        self.url = url
        self.asset = asset
        self.df = texts(ROWS)

    def run(
        self, partition: str, raise_on_error: bool = True, **config: Any
    ) -> dg.ExecuteInProcessResult:
        @dg.asset(name="texts", io_manager_key="source_io")
        def source() -> pl.DataFrame:
            return self.df

        return dg.materialize(
            [source, self.asset],
            instance=self.instance,
            partition_key=partition,
            resources={
                "io_manager": CheckpointIOManager(base_dir=str(self.base_dir)),
                "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
                "chat": OpenAIResource(base_url=self.url, api_key="local", model="m", max_tokens=1),
            },
            run_config={"ops": {ASSET: {"config": config}}},
            raise_on_error=raise_on_error,
        )

    def estimate(self, partition: str, **config: Any) -> Estimate:
        """A dry run's estimate of ``partition``, read from the observation it recorded."""
        result = self.run(partition, dry_run=True, **config)
        assert result.success
        (event,) = result.get_asset_observation_events()
        observation = event.asset_observation_data.asset_observation
        assert observation.partition == partition
        return md.estimate_of({k: md.plain(v) for k, v in observation.metadata.items()})

    def files(self) -> dict[str, bytes]:
        return {
            str(p.relative_to(self.base_dir)): p.read_bytes()
            for p in sorted(self.base_dir.rglob("*"))
            if p.is_file()
        }


def materialized(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    (event,) = result.asset_materializations_for_node(ASSET)
    return {k: md.plain(v) for k, v in event.metadata.items()}


@dg.asset(name="texts")
def stored_texts() -> pl.DataFrame:
    """``texts(ROWS)``, stored by the IO manager, for runs in other processes."""
    return texts(ROWS)


defs = dg.Definitions(
    assets=[stored_texts, online_asset()],
    resources={
        "io_manager": CheckpointIOManager(),
        "chat": OpenAIResource(
            base_url=dg.EnvVar("OPENAI_BASE_URL"), api_key="local", model="m", max_tokens=1
        ),
    },
)
