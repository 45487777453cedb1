"""``checkpoint-assets verify``: check every invariant of checkpoints.

The checks are in ``engine/upkeep/verify.py``.
"""

from __future__ import annotations

from typing import Any

import click

from checkpoint_assets.cli import shared
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.upkeep.verify import problems


@click.command(short_help="Check invariants; exit status 1 on any problem.")
@click.argument("base_dir")
@click.argument("name", required=False, callback=shared.checkpoint_name)
@shared.storage_options
def verify(base_dir: str, name: str | None, options: dict[str, Any]) -> int:
    """Check every invariant of one checkpoint, or of all; exit status 1 on any problem.

    The invariants: the meta, merged file and parts are readable. Each has the id column, of the
    recorded type, with unique ids. Each has the output columns where it holds results. The
    files agree on their columns. Each problem is printed as `NAME: problem` on stdout.
    """
    store = shared.existing(base_dir, options)
    names = shared.chosen(store, name)
    bad = 0
    with shared.steps(len(names)) as steps:
        for each in names:
            steps.start(each)
            found = problems(Checkpoint(store, each))
            for problem in found:
                click.echo(f"{each}: {problem}")
            steps.done(each, f"{len(found)} problem(s)" if found else "ok", notable=bool(found))
            bad += bool(found)
    if names:
        click.echo(f"Verified {len(names)} checkpoint(s): {bad} with problems.", err=True)
    return 1 if bad else 0
