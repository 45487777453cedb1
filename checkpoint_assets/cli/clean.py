"""``checkpoint-assets clean``: delete the checkpoints of a tag, each under its lock."""

from __future__ import annotations

import os
import sys
from typing import Any

import click
from rich.filesize import decimal

from checkpoint_assets.cli import shared
from checkpoint_assets.engine.checkpoints import layout
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.layout import split_name
from checkpoint_assets.engine.storage import FileInfo, LocalStore, open_store


@click.command(short_help="Delete the checkpoints of a tag.")
@click.argument("base_dir")
@click.option("--tag", required=True, help="The checkpoint tag whose checkpoints to delete.")
@click.option("--asset", help="Only the checkpoints of this asset (as `status` shows it).")
@click.option("--yes", is_flag=True, help="Delete without asking.")
@shared.storage_options
def clean(base_dir: str, tag: str, asset: str | None, yes: bool, options: dict[str, Any]) -> int:
    """Delete every checkpoint of a tag: merged file, parts, meta and lock.

    Asks first on a terminal; elsewhere it deletes only with --yes. A checkpoint that a live
    run holds is skipped (exit status 1); a lock left by a dead run is taken over. One that
    cannot be deleted is said as `NAME: error: ...` (exit status 2); the others are deleted.
    """
    store = open_store(base_dir, options)
    by_name = layout.files_by_name(
        ((f.path, f) for f in store.list_recursive(store.root)), store.root
    )
    names = [
        n
        for n in by_name
        if split_name(n)[1] == tag and (asset is None or split_name(n)[0] == asset)
    ]
    of = f"tag {tag!r}" + (f" of asset {asset!r}" if asset else "")
    if not names:
        click.echo(f"No checkpoints of {of} under {store.url}.", err=True)
        return 0
    files = [f for n in names for f in by_name[n]]
    what = (
        f"{len(names)} checkpoint(s) of {of} under {store.url} "
        f"({len(files)} files, {decimal(sum(f.size for f in files))})"
    )
    if not yes:
        if not sys.stdin.isatty():
            raise click.UsageError(
                f"Refusing to delete {what} without confirmation: nobody can answer here. "
                "Pass --yes to delete them."
            )
        for n in names:
            click.echo(f"  {n}", err=True)
        if not click.confirm(f"Delete {what}?", err=True):
            click.echo("Nothing deleted.", err=True)
            return 1
    handled = shared.each_under_lock(
        store, names, _delete, lambda gone: f"deleted {len(gone)} file(s)"
    )
    deleted = [f for gone in handled.done.values() for f in gone]
    click.echo(
        f"Deleted {len(handled.done)} checkpoint(s) of {of}: {len(deleted)} files, "
        f"{decimal(sum(f.size for f in deleted))}{handled.tail()}."
    )
    return handled.exit_status()


def _delete(checkpoint: Checkpoint) -> list[FileInfo]:
    """Delete every file of ``checkpoint`` under its lock, the meta last and then the lock."""
    with shared.locked(checkpoint):
        # Listed under the lock: nothing can be added any more.
        files = [f for f in checkpoint.list_files() if f.path != checkpoint.files.lock]
        checkpoint.store.delete(f.path for f in files if f.path != checkpoint.files.meta)
        # Without its meta a checkpoint is no longer listed: deleted last, nothing is orphaned.
        checkpoint.store.delete(f.path for f in files if f.path == checkpoint.files.meta)
    if isinstance(checkpoint.store, LocalStore):
        _remove_empty_folders(checkpoint.files.parts, checkpoint.store.root)
    return files


def _remove_empty_folders(folder: str, root: str) -> None:
    """Remove ``folder`` and then its parents up to ``root``, while they are empty (local disk;
    object stores have no folders)."""
    while folder.startswith(root + "/"):
        try:
            os.rmdir(folder)
        except OSError:  # not empty, or gone
            if os.path.isdir(folder):
                return
        folder = os.path.dirname(folder)
