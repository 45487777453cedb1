"""``checkpoint-assets status``: one row per checkpoint."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import click
import polars as pl
from rich.filesize import decimal

from checkpoint_assets.cli import shared
from checkpoint_assets.engine.checkpoints import layout
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.layout import split_name
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.loop.lock import Lease
from checkpoint_assets.engine.rows import ERROR
from checkpoint_assets.engine.storage import FileInfo, Store

STATUS_READERS = 16  # checkpoints `status` reads at once


@click.command(short_help="One row per checkpoint: rows, parts, size, lock, queue waits.")
@click.argument("base_dir", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, for scripts.")
@shared.storage_options
def status(base_dir: str | None, as_json: bool, options: dict[str, Any]) -> None:
    """One row per checkpoint: rows ok and failed, parts, size, last write, lock holder, usage,
    and the rows of provider batches that wait for room in the provider's queue.

    BASE_DIR defaults to $DAGSTER_HOME/checkpoints, the IO manager's default. Rows are counted
    in unmerged parts too (a run that was interrupted before it finished). Usage is the sum of
    each of the asset's usage_columns over the stored rows (tokens, cost).

    With --json each checkpoint is an object with these keys:

    \b
    - asset, tag, partition, rows_ok, rows_failed, parts, bytes;
    - last_write: ISO 8601, UTC;
    - lock: the holder, or null;
    - lock_stale: why the holder is dead, so that the next writer takes the lock over, or null;
    - usage: the sum of each usage column, by column;
    - rows_waiting_for_queue: provider batches: rows the provider's queue had no room for yet
      (0 when none);
    - error: why the checkpoint could not be read, or null.
    """
    if base_dir is None:
        home = os.environ.get("DAGSTER_HOME")
        if not home:
            raise click.UsageError(
                "Give BASE_DIR (the IO manager's base_dir), or set DAGSTER_HOME to list "
                "$DAGSTER_HOME/checkpoints."
            )
        base_dir = os.path.join(home, "checkpoints")
    store = shared.existing(base_dir, options)
    listing = store.list_recursive(store.root)  # one listing for every checkpoint's files
    by_name = layout.files_by_name(((f.path, f) for f in listing), store.root)
    # Each checkpoint costs a request or more: its meta, and its parts and lock when it has them.
    # Read one after the other, a thousand shards on an object store take a thousand round trips.
    with ThreadPoolExecutor(STATUS_READERS) as pool:
        summaries = list(pool.map(lambda item: _summary(store, *item), by_name.items()))
    if as_json:
        click.echo(json.dumps(summaries, indent=2))
        return
    if not summaries:
        click.echo(f"No checkpoints under {store.url}.", err=True)
        return
    columns = ["asset", "tag", "partition", "rows ok", "rows failed", "parts", "size"]
    columns += ["last write", "lock"]
    with_usage = any(s["usage"] for s in summaries)
    with_queue = any(s["rows_waiting_for_queue"] for s in summaries)
    extra = (["usage"] if with_usage else []) + (["waiting for queue"] if with_queue else [])
    rows = shared.table(*columns, *extra)
    for s in summaries:
        counts = ["?", "?"] if s["error"] else [f"{s['rows_ok']:,}", f"{s['rows_failed']:,}"]
        usage = ", ".join(f"{c} {v:,.6g}" for c, v in s["usage"].items()) or "-"
        rows.add_row(
            s["asset"],
            s["tag"],
            s["partition"],
            *counts,
            str(s["parts"]),
            decimal(s["bytes"]),
            shared.when(s["last_write"]),
            (f"{s['lock']} (stale: {s['lock_stale']})" if s["lock_stale"] else s["lock"]) or "-",
            *([usage] if with_usage else []),
            *([f"{s['rows_waiting_for_queue']:,}"] if with_queue else []),
        )
    shared.console().print(rows)
    for s in summaries:
        if s["error"]:
            name = f"{s['asset']}/{s['tag']}/{s['partition']}"
            click.echo(f"{name}: {s['error']}", err=True)


def _summary(store: Store, name: str, files: Sequence[FileInfo]) -> dict[str, Any]:
    """What ``status`` shows of one checkpoint (``files``, as listed); reads beyond the listing
    only when needed."""
    checkpoint = Checkpoint(store, name)
    asset, tag, partition = split_name(name)
    parts = checkpoint.list_parts(files)[0]
    ok: int | None = None
    failed: int | None = None
    usage: dict[str, float] = {}
    error: str | None = None
    try:
        meta = checkpoint.meta_file.read()
        if meta is None:
            raise CheckpointError(f"No checkpoint {name!r} under {store.url} (no meta file).")
        usage = dict(meta.usage)  # the usage_columns' sums at the last finalize
        if not parts and meta.finalized_at is not None and "ok" in meta.rows:
            ok, failed = meta.rows["ok"], meta.rows.get("failed", 0)
        else:  # rows of a run that did not finish are only in its parts
            stored = checkpoint.load(meta.id_column, meta.base_seq)
            ok, failed = _counts(stored.rows)
            parts = stored.parts
            current = shared.result_rows(stored.rows)
            usage = {c: float(current.get_column(c).sum() or 0) for c in usage if c in current}
    except CheckpointError as e:
        error = str(e)
    waiting = 0
    if any(f.path == checkpoint.files.queue_waiting for f in files):
        try:
            waiting = int(json.loads(store.get(checkpoint.files.queue_waiting))["rows"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            waiting = 0  # gone since the listing, or torn: the next run writes it again
    lease = Lease(store, checkpoint.files.lock)
    holder = lease.read() if any(f.path == checkpoint.files.lock for f in files) else None
    # A lock whose holder is dead is taken over by the next writer (see ``lock.py``).
    stale = lease.dead_reason(holder) if holder else None
    return {
        "asset": asset,
        "tag": tag,
        "partition": partition,
        "rows_ok": ok,
        "rows_failed": failed,
        "parts": len(parts),
        "bytes": sum(f.size for f in files),
        "last_write": shared.iso(max((f.mtime or 0 for f in files), default=0)),
        "lock": holder.describe() if holder else None,
        "lock_stale": stale,
        "usage": usage,
        "rows_waiting_for_queue": waiting,
        "error": error,
    }


def _counts(rows: pl.DataFrame) -> tuple[int, int]:
    """(ok, failed) rows of the result."""
    current = shared.result_rows(rows)
    failed = int(current.get_column(ERROR).is_not_null().sum()) if ERROR in current.columns else 0
    return current.height - failed, failed
