"""``checkpoint-assets repair``: rebuild checkpoints from what is readable, under each lock."""

from __future__ import annotations

import json
from typing import Any

import click

from checkpoint_assets.cli import shared
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.upkeep.repair import Repaired, repair


@click.command("repair", short_help="Rebuild from what is readable; damaged files kept aside.")
@click.argument("base_dir")
@click.argument("name", required=False, callback=shared.checkpoint_name)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, for scripts.")
@shared.storage_options
def repair_command(base_dir: str, name: str | None, as_json: bool, options: dict[str, Any]) -> int:
    """Rebuild one checkpoint, or all, from what is readable, under each lock.

    Damaged files are moved aside to NAME.parquet.quarantine/, never deleted. They are what
    `verify` flags: an unreadable or inconsistent merged file and parts. What is left is merged
    into a new merged file, and the next run computes the rows lost with them.

    A checkpoint whose meta file is unreadable or missing cannot be rebuilt. The meta file is the
    only record of the job that wrote the rows. So all its files are moved aside and the next run
    starts it again. NAME is needed for a checkpoint without a meta file, which is not listed.

    Stale temporary files of killed writes are deleted. A checkpoint a live run holds is skipped
    (exit status 1). One that cannot be repaired is said as `NAME: error: ...` with what to do
    (exit status 2).

    Each file moved aside is printed as `NAME: moved FILE to QUARANTINED (problem)`, then
    `NAME: what was done`. With --json each checkpoint is an object with these keys:

    \b
    - name;
    - moved: a list of path, to, problem;
    - removed_temporary, parts_merged, rows_ok, rows_failed;
    - meta_lost: why the meta file could not be used, or null;
    - skipped: why it was not repaired, or null;
    - error: what kept it from being repaired, or null.
    """
    store = shared.existing(base_dir, options)
    names = shared.chosen(store, name)

    def repair_one(checkpoint: Checkpoint) -> Repaired:
        done = repair(checkpoint)
        if not as_json:
            for moved in done.moved:
                click.echo(f"{done.name}: moved {moved.path} to {moved.to} ({moved.problem})")
            click.echo(f"{done.name}: {done.summary()}")
        return done

    handled = shared.each_under_lock(store, names, repair_one, lambda _: "repaired")
    if as_json:
        reports = [
            _repaired(handled.done[n])
            if n in handled.done
            else {"name": n, "skipped": handled.skipped.get(n), "error": handled.failed.get(n)}
            for n in names
        ]
        click.echo(json.dumps(reports, indent=2))
    if names:
        click.echo(f"Repaired {len(handled.done)} checkpoint(s){handled.tail()}.", err=True)
    return handled.exit_status()


def _repaired(done: Repaired) -> dict[str, Any]:
    return {
        "name": done.name,
        "moved": [{"path": m.path, "to": m.to, "problem": m.problem} for m in done.moved],
        "removed_temporary": done.removed_temporary,
        "parts_merged": done.parts_merged,
        "rows_ok": done.rows_ok,
        "rows_failed": done.rows_failed,
        "meta_lost": done.meta_lost,
        "skipped": None,
        "error": None,
    }
