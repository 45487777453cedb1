"""``checkpoint-assets inspect``: one checkpoint's meta, schema, counts, errors and sample rows."""

from __future__ import annotations

import json
from typing import Any

import click
import polars as pl
from rich.table import Table

from checkpoint_assets.cli import shared
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.meta import Meta
from checkpoint_assets.engine.rows import BOOKKEEPING, ERROR

SAMPLE_ROWS = 5
TOP_ERRORS = 10
SAMPLE_IDS = 3


@click.command(short_help="Meta, schema, counts, top errors, sample rows.")
@click.argument("base_dir")
@click.argument("name", callback=shared.checkpoint_name)
@click.option("--failed", is_flag=True, help="Print only the ids of failed rows, one per line.")
@shared.storage_options
def inspect(base_dir: str, name: str, failed: bool, options: dict[str, Any]) -> None:
    """Meta, schema, counts, most common errors and sample rows of one checkpoint."""
    store = shared.existing(base_dir, options)
    checkpoint = Checkpoint(store, name)
    meta = checkpoint.meta_file.required()
    stored = checkpoint.load(meta.id_column, meta.base_seq)
    current = shared.result_rows(stored.rows)
    errors = current.filter(pl.col(ERROR).is_not_null()) if ERROR in current.columns else None
    if failed:
        if errors is not None and errors.height:
            shared.echo_lines(str(i) for i in errors.get_column(meta.id_column).sort())
        return
    console = shared.console()
    n_failed = errors.height if errors is not None else 0
    old = stored.rows.height - current.height
    gone = f"; {old:,} more stored for ids no longer in the input" if old else ""
    for key, value in [
        ("checkpoint", checkpoint.url),
        ("job", f"{meta.job_fingerprint}  {json.dumps(meta.job, sort_keys=True)}"),
        ("scheme", meta.scheme.label if meta.scheme else "-"),
        ("input", f"{meta.input_fingerprint or '-'}  (input hash format {meta.input_hash_format})"),
        ("finalized", shared.when(meta.finalized_at)),
        ("parts", f"{len(stored.parts)} unmerged (merged up to flush {stored.watermark})"),
        ("rows", f"{current.height - n_failed:,} ok, {n_failed:,} failed" + gone),
    ]:
        click.echo(f"{key:<11} {value}")
    console.print()
    console.print(_schema(meta))
    if errors is not None and errors.height:
        console.print()
        console.print(_top_errors(errors, meta.id_column))
    console.print()
    console.print(_sample(current, meta.id_column))


def _schema(meta: Meta) -> Table:
    table = shared.table("column", "type", "role")
    table.title = "schema"
    table.add_row(meta.id_column, meta.id_dtype, "id")
    for column, dtype in (meta.output_schema or {}).items():
        table.add_row(column, dtype, "output")
    return table


def _top_errors(errors: pl.DataFrame, id_column: str) -> Table:
    top = (
        errors.group_by(ERROR)
        .agg(pl.len().alias("rows"), pl.col(id_column).sort().head(SAMPLE_IDS).alias("ids"))
        .sort(["rows", ERROR], descending=[True, False])
    )
    table = shared.table("rows", "error", "sample ids")
    table.title = f"most common errors ({top.height} distinct)"
    for error, count, ids in top.head(TOP_ERRORS).iter_rows():
        sample = ", ".join(shared.short(i, 40) for i in ids)
        table.add_row(f"{count:,}", shared.short(error, 300), sample)
    return table


def _sample(current: pl.DataFrame, id_column: str) -> Table:
    shown = [c for c in current.columns if c not in BOOKKEEPING or c == ERROR]
    table = shared.table(*shown)
    table.title = f"sample rows (first {min(SAMPLE_ROWS, current.height)} of {current.height:,})"
    for row in current.select(shown).head(SAMPLE_ROWS).iter_rows():
        table.add_row(*(shared.short(v, 60) for v in row))
    return table
