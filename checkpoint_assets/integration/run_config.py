"""The run config of a checkpointed asset (UI launchpad, ``--config-json``) and how it applies to
the asset's settings.

No ``from __future__ import annotations`` here: Dagster reads the config classes' annotations.
"""

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

import dagster as dg
from pydantic import Field, model_validator

from checkpoint_assets.engine.calls.budget import Budget
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.settings import OnInputChange, Settings

T = TypeVar("T")


class BudgetLimits(dg.Config):
    """The spend limits of one run, replacing the asset's budget's (``budget`` in run config)."""

    max_run_cost: float | None = Field(
        default=None, ge=0, description="USD this run may spend (default: the asset's)."
    )
    max_asset_cost: float | None = Field(
        default=None,
        ge=0,
        description="USD the asset may have spent, every shard and run (default: the asset's).",
    )


class CheckpointRunConfig(dg.Config):
    """Run config of a checkpointed asset (UI launchpad, ``--config-json``)."""

    resume: bool = Field(
        default=True,
        description="Skip rows the checkpoint holds. false: recompute all (still checkpointing).",
    )
    checkpointing: bool = Field(
        default=True,
        description="Write a checkpoint. false: compute in memory, write nothing, resume nothing.",
    )
    checkpoint_tag: str | None = Field(
        default=None, description="Name of the checkpoint, to keep separate runs apart."
    )
    checkpoint_interval: int | None = Field(
        default=None, ge=1, description="Rows per flush, at least 1 (overrides the asset's)."
    )
    batch_size: int | None = Field(
        default=None,
        ge=1,
        description="Rows per call, at least 1 (overrides the asset's; default: the checkpoint "
        "interval).",
    )
    global_resume: bool = Field(
        default=False,
        description="Take finished rows from every checkpoint of the asset (after a reshard).",
    )
    limit: int | None = Field(
        default=None, ge=0, description="Process only the first N rows of the shard (a smoke run)."
    )
    retry_failed: bool | None = Field(
        default=None, description="Compute rows stored as failed again (default: the asset's)."
    )
    on_input_change: OnInputChange | None = Field(
        default=None,
        description="fail or recompute finished rows whose input changed (default: the asset's).",
    )
    budget: BudgetLimits | None = Field(
        default=None,
        description="{max_run_cost, max_asset_cost}: spend limits in USD replacing the asset's "
        "budget's (raise them to go on after BudgetExceededError).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "CheckpointRunConfig":
        # Checked when the step starts, before the source is read or anything is computed.
        if self.global_resume and not self.resume:
            raise ValueError(
                "global_resume: true takes finished rows from other checkpoints, but resume: "
                "false computes every row again, so they cannot both hold. Drop global_resume to "
                "recompute everything, or drop resume: false to take the finished rows."
            )
        return self


def apply(base: Settings, config: CheckpointRunConfig, columns: Sequence[str]) -> Settings:
    """The engine settings of this run: the decorator's, with the run config applied."""
    return dataclasses.replace(
        base,
        input_columns=base.input_columns or tuple(c for c in columns if c != base.id_column),
        checkpoint_interval=_given(config.checkpoint_interval, base.checkpoint_interval),
        batch_size=_given(config.batch_size, base.batch_size),
        resume=config.resume,
        checkpointing=config.checkpointing,
        retry_failed=_given(config.retry_failed, base.retry_failed),
        on_input_change=_given(config.on_input_change, base.on_input_change),
        budget=_budget(base.budget, config.budget),
    )


def _budget(base: Budget | None, limits: BudgetLimits | None) -> Budget | None:
    """The asset's budget with the run config's limits."""
    if limits is None:
        return base
    if base is None:
        raise CheckpointError(
            "Run config sets `budget` limits, but the asset has no budget: without prices, "
            "what calls cost is unknown.",
            "Give the asset `budget=Budget(prices=...)`, or drop `budget` from run config.",
        )
    return dataclasses.replace(
        base,
        max_run_cost=_given(limits.max_run_cost, base.max_run_cost),
        max_asset_cost=_given(limits.max_asset_cost, base.max_asset_cost),
    )


def _given(value: T | None, asset_value: T) -> T:
    """The run config's value when it gives one (0 and false included), else the asset's."""
    return asset_value if value is None else value
