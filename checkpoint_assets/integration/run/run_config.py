"""The run config of a checkpointed asset (UI launchpad, ``--config-json``) and how it applies to
the asset's settings.

No ``from __future__ import annotations`` here: Dagster reads the config classes' annotations.
"""

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field, model_validator

from checkpoint_assets.engine.calls.budget import LIMITS, Budget, check_limit
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.settings import AssetSettings, OnInputChange, Settings
from checkpoint_assets.integration.run.models import given, model_of

# The asset's settings a run may override: run config keys of the same name and meaning.
OVERRIDDEN = (
    "checkpoint_interval",
    "batch_size",
    "retry_failed",
    "on_input_change",
    "stop_at_failed_shard",
)


def _check_limits(limits: dict[str, Any]) -> None:
    for name, value in limits.items():
        check_limit(name, value)


if TYPE_CHECKING:
    BudgetLimits = dg.Config
    _AssetOverrides = dg.Config
else:
    BudgetLimits = model_of(
        Budget,
        dg.Config,
        name="BudgetLimits",
        module=__name__,
        doc="The spend limits of one run, replacing the asset's budget's (``budget`` in run "
        "config).",
        only=LIMITS,
        overrides=True,
        check=_check_limits,
    )
    # A value out of range is refused by the asset's own rule, which names the key.
    _AssetOverrides = model_of(
        AssetSettings,
        dg.Config,
        name="AssetOverrides",
        module=__name__,
        doc="The asset's settings a run overrides.",
        only=OVERRIDDEN,
        types={"on_input_change": OnInputChange},
        overrides=True,
        check=lambda values: AssetSettings(**values),
    )


class CheckpointRunConfig(_AssetOverrides):
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
    global_resume: bool = Field(
        default=False,
        description="Take finished rows from every checkpoint of the asset (after a reshard).",
    )
    reuse: bool | None = Field(
        default=None,
        description="false: neither take results from the result store nor add to it in this "
        "run; true: both. Default: the asset's.",
    )
    limit: int | None = Field(
        default=None, ge=0, description="Process only the first N rows of the shard (a smoke run)."
    )
    dry_run: bool = Field(
        default=False,
        description="Compute and write nothing: estimate each shard's rows, tokens and cost, "
        "recorded as an observation of its partition; nothing materializes.",
    )
    budget: BudgetLimits | None = Field(
        default=None,
        description=f"{{{', '.join(LIMITS)}}}: spend limits in USD replacing the asset's "
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
        resume=config.resume,
        checkpointing=config.checkpointing,
        budget=_budget(base.budget, config.budget),
        **given(config, OVERRIDDEN),
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
    return dataclasses.replace(base, **given(limits, LIMITS))
