"""``checkpoint-assets estimate``: the rows, tokens and cost a run would take, computing nothing.

The user's definitions load as ``dagster asset materialize`` loads them (``-m``, ``-f``, ``-a``,
``-d``: Dagster's own options and loader). Each partition then runs in process with
``dry_run: true`` on the Dagster instance of ``$DAGSTER_HOME`` (a temporary one when it is
unset). So the estimate is the dry run's own: the asset's resources, IO manager and run config,
its observations in the instance. The figures printed are read back from those observations.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click
from dagster_shared.cli import PythonPointerOpts, python_pointer_options

from checkpoint_assets.cli import shared
from checkpoint_assets.engine.plan.estimate import Estimate


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

    With --json: `{"asset", "shards": [{"partition", <figures>}], "total": {<figures>}}`.
    """
    config = _config(config_json)
    # Dagster loads only here: the CLI's other commands start without it.
    from checkpoint_assets.cli import dry_runs

    pointer_opts = PythonPointerOpts.extract_from_cli_options(pointer)
    shards = dry_runs.estimates(pointer_opts, asset, partitions, config)
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
