"""The Dagster side of ``checkpoint-assets estimate``: dry runs of an asset's partitions.

The user's definitions load as ``dagster asset materialize`` loads them. Each partition then
runs in process with ``dry_run: true``; its estimate is read back from the run's observations.
The CLI imports this module only when it estimates, so its other commands start without Dagster.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import click
import dagster as dg

# Dagster's loader of ``-m``/``-f`` definitions, as its CLI uses it: no public API offers it.
from dagster._cli.workspace.cli_target import get_repository_python_origin_from_cli_opts
from dagster._utils.hosted_user_process import recon_repository_from_origin
from dagster_shared.cli import PythonPointerOpts

from checkpoint_assets.engine.checkpoints.layout import UNPARTITIONED
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.plan.estimate import Estimate
from checkpoint_assets.integration import metadata as md

# The run's own log stays in the instance; a failure is said once, by its cause (``_failure``).
_QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


def estimates(
    pointer: PythonPointerOpts, asset: str, partitions: Sequence[str], config: dict[str, Any]
) -> dict[str, Estimate]:
    """The estimate of each partition of ``asset`` (those given, else every one)."""
    repo = _definitions(pointer)
    key = dg.AssetKey.from_user_string(asset)
    assets_def = _checkpointed(repo, key)
    home = os.environ.get("DAGSTER_HOME")
    with dg.DagsterInstance.get() if home else dg.DagsterInstance.ephemeral() as instance:
        keys = _partitions(assets_def, partitions, instance)
        job = repo.get_implicit_job_def_for_assets([key])
        if job is None:  # every asset of a repository has an implicit job
            raise CheckpointError(f"No job of the definitions materializes {asset}.")
        name = assets_def.node_def.name
        run_config = {"ops": {name: {"config": {**config, "dry_run": True}}}, **_QUIET}
        shards: dict[str, Estimate] = {}
        for partition in keys:
            result = job.execute_in_process(
                run_config=run_config,
                instance=instance,
                partition_key=partition,
                asset_selection=[key],
                raise_on_error=False,
            )
            shards.update(_estimates(result, partition, asset))
    return shards


def _definitions(pointer: PythonPointerOpts) -> dg.RepositoryDefinition:
    """The user's definitions, loaded as ``dagster asset materialize`` loads them."""
    origin = get_repository_python_origin_from_cli_opts(pointer)
    return recon_repository_from_origin(origin).get_definition()


def _checkpointed(repo: dg.RepositoryDefinition, key: dg.AssetKey) -> dg.AssetsDefinition:
    """The checkpointed asset ``key`` of ``repo``, or an error naming those there are."""
    found = repo.assets_defs_by_key.get(key)
    if found is not None and md.ID_COLUMN in found.metadata_by_key.get(key, {}):
        return found
    checkpointed = sorted(
        k.to_user_string()
        for k, a in repo.assets_defs_by_key.items()
        if md.ID_COLUMN in a.metadata_by_key.get(k, {})
    )
    what = "is not a checkpointed asset" if found is not None else "is not in the definitions"
    raise CheckpointError(
        f"{key.to_user_string()} {what}; only a checkpointed asset has an estimate.",
        f"Name one of: {', '.join(checkpointed) or 'none found'}.",
    )


def _partitions(
    assets_def: dg.AssetsDefinition, given: Sequence[str], instance: dg.DagsterInstance
) -> list[str | None]:
    """The partitions to estimate: those given (checked), else every one."""
    partitions_def = assets_def.partitions_def
    if partitions_def is None:
        if given:
            raise click.BadParameter("the asset is not partitioned", param_hint="--partition")
        return [None]
    every = partitions_def.get_partition_keys(dynamic_partitions_store=instance)
    unknown = [p for p in given if p not in every]
    if unknown:
        shown = ", ".join(every[:8]) + (", ..." if len(every) > 8 else "")
        raise click.BadParameter(
            f"no partition {', '.join(unknown)} (the asset's: {shown})", param_hint="--partition"
        )
    return list(given or every)


def _estimates(
    result: dg.ExecuteInProcessResult, partition: str | None, asset: str
) -> dict[str, Estimate]:
    """The estimates the dry run recorded, by partition; its error when it failed."""
    if not result.success:
        where = f"{asset} {partition or UNPARTITIONED}"
        raise CheckpointError(f"The dry run of {where} failed: {_failure(result)}")
    found: dict[str, Estimate] = {}
    for event in result.get_asset_observation_events():
        observation = event.asset_observation_data.asset_observation
        metadata = {k: md.plain(v) for k, v in observation.metadata.items()}
        if any(k.startswith(md.ESTIMATE) for k in metadata):
            found[observation.partition or UNPARTITIONED] = md.estimate_of(metadata)
    return found


def _failure(result: dg.ExecuteInProcessResult) -> str:
    """What failed the run (a step, a resource), without Dagster's wrapping errors."""
    for event in result.all_events:
        error = getattr(event.event_specific_data, "error", None)
        while (
            error is not None and error.cause is not None and error.cls_name.startswith("Dagster")
        ):
            error = error.cause
        if error is not None:
            named, _, said = str(error.message).strip().partition(": ")
            return f"{error.cls_name}: {said if named.endswith(error.cls_name) else named}"
    return f"see run {result.run_id} in the instance's log"
