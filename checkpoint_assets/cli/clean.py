"""``checkpoint-assets clean``: delete the checkpoints of a tag, each under its lock; or keep the
result store bounded (``--older-than``, ``--max-bytes``), merging its small files."""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

import click
from rich.filesize import decimal

from checkpoint_assets.cli import shared
from checkpoint_assets.engine.checkpoints import layout
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.layout import split_name
from checkpoint_assets.engine.reuse import layout as reuse_layout
from checkpoint_assets.engine.reuse import upkeep
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.storage import FileInfo, LocalStore, open_store

_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_BYTES = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTES |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", value.strip().lower()) if value else None
    if value is not None and found is None:
        raise click.BadParameter(
            f"{value!r} is no duration: give a number and s, m, h, d or w, such as 30d."
        )
    return float(found[1]) * _SECONDS[found[2]] if found else None


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value.strip().lower()) if value else None
    if value is not None and (found is None or found[2] not in _BYTES):
        raise click.BadParameter(
            f"{value!r} is no size: give bytes, or a number and KB, MB, GB, "
            "TB (or KiB, MiB, GiB, TiB), such as 20GB."
        )
    return int(float(found[1]) * _BYTES[found[2]]) if found else None


@click.command(short_help="Delete the checkpoints of a tag, or old results of the result store.")
@click.argument("base_dir")
@click.option("--tag", help="The checkpoint tag whose checkpoints to delete.")
@click.option("--asset", help="Only the checkpoints of this asset (as `status` shows it).")
@click.option(
    "--results",
    is_flag=True,
    help="Clean the result store instead: merge its small files, and delete by --older-than "
    "and --max-bytes.",
)
@click.option(
    "--older-than",
    callback=_duration,
    help="With --results: delete results stored longer ago than this (30d, 12h, 90m).",
)
@click.option(
    "--max-bytes",
    callback=_size,
    help="With --results: then delete the oldest results until the store holds at most this "
    "(20GB, 500MiB).",
)
@click.option(
    "--result-store",
    help="With --results: where the result store is, if not in BASE_DIR's 'result-store' "
    "folder (the IO manager's result_store).",
)
@click.option("--yes", is_flag=True, help="Delete without asking.")
@shared.storage_options
def clean(
    base_dir: str,
    tag: str | None,
    asset: str | None,
    results: bool,
    older_than: float | None,
    max_bytes: int | None,
    result_store: str | None,
    yes: bool,
    options: dict[str, Any],
) -> int:
    """Delete every checkpoint of a tag (--tag): merged file, parts, meta and lock. Or, with
    --results, keep the result store bounded.

    Asks first on a terminal; elsewhere it deletes only with --yes. A checkpoint that a live
    run holds is skipped (exit status 1); a lock left by a dead run is taken over. One that
    cannot be deleted is said as `NAME: error: ...` (exit status 2); the others are deleted.

    With --results it deletes result files stored longer ago than --older-than, then the oldest
    until the store holds at most --max-bytes. Then it merges each bucket's small files into
    one. Runs may go on meanwhile: files are written new and deleted, never changed.
    """
    if results == (tag is not None):
        raise click.UsageError(
            "Give --tag TAG to delete checkpoints, or --results to clean the "
            "result store (not both)."
        )
    if not results and (older_than is not None or max_bytes is not None or result_store):
        raise click.UsageError("--older-than, --max-bytes and --result-store go with --results.")
    if results:
        return _clean_results(base_dir, result_store, older_than, max_bytes, yes, options)
    assert tag is not None
    return _clean_tag(base_dir, tag, asset, yes, options)


def _clean_tag(
    base_dir: str, tag: str, asset: str | None, yes: bool, options: dict[str, Any]
) -> int:
    """``clean --tag``: delete the tag's checkpoints, each under its lock."""
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


def _clean_results(
    base_dir: str,
    result_store: str | None,
    older_than: float | None,
    max_bytes: int | None,
    yes: bool,
    options: dict[str, Any],
) -> int:
    """``clean --results``: delete by age and size, then merge small files."""
    if result_store is None:
        store = open_store(base_dir, options)
        found = ResultStore(store, store.path(reuse_layout.FOLDER))
    else:
        found = ResultStore(open_store(result_store, options))
    files, now = found.files(), time.time()
    gone = upkeep.chosen(files, older_than=older_than, max_bytes=max_bytes, now=now)
    what = (
        f"{len(gone)} of the {len(files)} result file(s) of the result store {found.url} "
        f"({decimal(sum(f.size for f in gone))} of {decimal(sum(f.size for f in files))})"
    )
    if gone and not yes:
        if not sys.stdin.isatty():
            raise click.UsageError(
                f"Refusing to delete {what} without confirmation: nobody can answer here. "
                "Pass --yes to delete them."
            )
        if not click.confirm(f"Delete {what}?", err=True):
            click.echo("Nothing deleted.", err=True)
            return 1
    done = upkeep.clean(found, older_than=older_than, max_bytes=max_bytes, now=now)
    click.echo(
        f"Deleted {len(done.deleted)} result file(s) ({decimal(done.deleted_bytes)}) and merged "
        f"{done.merged} small file(s) of the result store {found.url}; it holds "
        f"{decimal(done.kept_bytes)}."
    )
    return 0


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
