"""``checkpoint-assets estimate``: the rows, tokens and cost a run would take, computing nothing.

The user's definitions load as ``dagster asset materialize`` loads them (``-m``, ``-f``, ``-a``,
``-d``: Dagster's own options and loader). Each partition then runs in process with
``dry_run: true`` on the Dagster instance of ``$DAGSTER_HOME`` (a temporary one when it is
unset). So the estimate is the dry run's own: the asset's resources, IO manager and run config,
its observations in the instance. The figures printed are read back from those observations.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import click
import dagster as dg

# Dagster's loader of ``-m``/``-f`` definitions, as its CLI uses it: no public API offers it.
from dagster._cli.workspace.cli_target import get_repository_python_origin_from_cli_opts
from dagster._utils.hosted_user_process import recon_repository_from_origin
from dagster_shared.cli import PythonPointerOpts, python_pointer_options

from checkpoint_assets.cli import shared
from checkpoint_assets.engine.checkpoints.layout import UNPARTITIONED
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.plan.estimate import Estimate
from checkpoint_assets.integration import metadata as md

# The run's own log stays in the instance; a failure is said once, by its cause (``_failure``).
_QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


@click.command(short_help="Rows, tokens and cost a run would take, computing nothing.")
@click.argument("asset")
@click.option(
    "--partition",
    "-p",
    "partitions",
    multiple=True,
    metavar="KEY",
    help="A partition (shard) to estimate; repeatable. Default: every partition.",
)
@click.option(
    "--config-json",
    "config_json",
    metavar="JSON",
    help='The asset\'s run config, such as \'{"checkpoint_tag": "v2"}\'; dry_run is added.',
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object, for scripts.")
@python_pointer_options
def estimate(
    asset: str,
    partitions: Sequence[str],
    config_json: str | None,
    as_json: bool,
    **pointer: Any,
) -> None:
    """Estimate what materializing ASSET would compute and cost, computing and writing nothing.

    ASSET is a checkpointed asset's key (`ticket_routing`, `prefix/name`). Definitions load as
    for `dagster asset materialize`: -m MODULE or -f FILE. Each partition runs in process with
    `dry_run: true` on the instance of $DAGSTER_HOME. The run records its estimate as an
    observation of the partition; it computes nothing and materializes nothing.

    Per shard and in total: rows; rows done (resume); reparsed (stored answers, a changed
    parse); submitted (in provider batches not yet
    collected); reused (the result store); deduped; to compute. Input tokens (tiktoken if
    installed, else bytes/4). Output tokens: each request's max_tokens, a ceiling. With a
    budget, the cost online and as provider batches.

    With --json: {"asset", "shards": [{"partition", <figures>}], "total": {<figures>}}.
    """
    config = _config(config_json)
    repo = _definitions(PythonPointerOpts.extract_from_cli_options(pointer))
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
    _print(asset, shards, as_json)


def _config(config_json: str | None) -> dict[str, Any]:
    if not config_json:
        return {}
    try:
        config = json.loads(config_json)
    except ValueError as e:
        raise click.BadParameter(f"not JSON ({e})", param_hint="--config-json") from None
    if not isinstance(config, dict):
        raise click.BadParameter(
            "give the asset's run config as a JSON object, such as '{\"limit\": 100}'",
            param_hint="--config-json",
        )
    return config


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


_COLUMNS = {
    "rows_total": "rows",
    "rows_done": "done",
    "rows_reparsed": "reparsed",
    "rows_submitted": "submitted",
    "rows_reused": "reused",
    "rows_deduped": "deduped",
    "rows_to_compute": "to compute",
    "input_tokens": "input tokens",
    "output_tokens": "output tokens (max)",
}


def _print(asset: str, shards: dict[str, Estimate], as_json: bool) -> None:
    total = Estimate.total(shards.values())
    if as_json:
        listed = [{"partition": p, **e.as_dict()} for p, e in shards.items()]
        click.echo(json.dumps({"asset": asset, "shards": listed, "total": total.as_dict()}))
        return
    priced = total.cost_online_usd is not None
    costs = ["online USD", "batch USD"] if priced else []
    table = shared.table("partition", *_COLUMNS.values(), *costs)
    for partition, found in [*shards.items(), ("total", total)]:
        figures = [f"{getattr(found, name):,}" for name in _COLUMNS]
        usd = [found.cost_online_usd, found.cost_batch_usd] if priced else []
        table.add_row(partition, *figures, *(f"{u:,.4f}" for u in usd if u is not None))
    shared.console().print(table)
    notes = [f"Input tokens counted by {total.tokenizer}."]
    if total.rows_uncapped:
        notes.append(
            f"{total.rows_uncapped:,} row(s) name no max_tokens: their output tokens are not "
            "counted (set max_tokens on the resource or the request)."
        )
    if not priced:
        notes.append("No cost: the asset has no budget (give it budget=Budget(prices=...)).")
    click.echo(" ".join(notes), err=True)
