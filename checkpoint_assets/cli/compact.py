"""``checkpoint-assets compact``: merge unmerged parts, under each checkpoint's lock."""

from __future__ import annotations

from typing import Any

import click

from checkpoint_assets.cli import shared
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint


@click.command(short_help="Merge unmerged parts, under each lock.")
@click.argument("base_dir")
@click.argument("name", required=False, callback=shared.checkpoint_name)
@shared.storage_options
def compact(base_dir: str, name: str | None, options: dict[str, Any]) -> int:
    """Merge the unmerged parts of one checkpoint, or of all, into their merged file.

    Each checkpoint is compacted under its lock; one that a live run holds is skipped (exit
    status 1). One that cannot be compacted (a damaged file, no meta file) is left as it is.
    It is said as `NAME: error: ...` with what to do (exit status 2). The others are compacted.
    """
    store = shared.existing(base_dir, options)
    names = shared.chosen(store, name)
    handled = shared.each_under_lock(
        store, names, _compact_one, lambda count: f"merged {count} part(s)"
    )
    if names:
        merged = sum(handled.done.values())
        click.echo(
            f"Merged {merged} part(s) in {len(handled.done)} checkpoint(s){handled.tail()}.",
            err=True,
        )
    return handled.exit_status()


def _compact_one(checkpoint: Checkpoint) -> int:
    """Merge the parts of ``checkpoint`` under its lock; returns how many were merged."""
    meta = checkpoint.meta_file.required()
    with shared.locked(checkpoint):
        stored = checkpoint.load(meta.id_column, meta.base_seq)
        checkpoint.finalize(meta.id_column, None, meta.base_seq, known=stored)
    return len(stored.parts)
