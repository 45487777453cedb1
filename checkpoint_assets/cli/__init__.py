"""``checkpoint-assets``: look at and look after checkpoints, without Dagster running.

- ``checkpoint-assets status [BASE_DIR] [--json]``: one row per checkpoint.
- ``checkpoint-assets inspect BASE_DIR NAME [--failed]``: meta, schema, counts, errors, sample
  rows.
- ``checkpoint-assets verify BASE_DIR [NAME]``: check invariants; exit 1 on any problem.
- ``checkpoint-assets compact BASE_DIR [NAME]``: merge unmerged parts (takes the lock).
- ``checkpoint-assets repair BASE_DIR [NAME] [--json]``: rebuild from what is readable, damaged
  files kept aside (takes the lock).
- ``checkpoint-assets clean BASE_DIR --tag TAG``: delete the checkpoints of a tag;
  ``clean BASE_DIR --results --older-than 30d --max-bytes 20GB``: keep the result store bounded.
- ``checkpoint-assets estimate -m MODULE ASSET``: the rows, tokens and cost a run would take.

``BASE_DIR`` is the IO manager's ``base_dir`` (a local path or an fsspec URI). ``NAME`` is a
checkpoint as ``status`` lists it (``ticket_routing/default/3-of-8``). Storage options are given
as ``-o key=value`` (values may be JSON) or come from the environment, as for the IO manager.

Results go to stdout: tables, or JSON and ids for scripts. Progress and notes go to stderr: a
progress bar on a terminal, one line per checkpoint otherwise. The exit status is, as for other
command-line tools:

- 0 when all is well;
- 1 when something was found or skipped;
- 2 on an error: ``error: ...`` on stderr, or ``NAME: error: ...`` for a checkpoint that
  ``compact``, ``repair`` or ``clean`` could not handle;
- 141 when stdout is closed early (``| head``).

One module per command; ``shared.py`` holds their arguments, output and the loop of the commands
that change checkpoints under each lock.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import click

from checkpoint_assets.cli import clean, compact, estimate, inspect, repair, status, verify
from checkpoint_assets.engine.errors import CheckpointError

PIPE_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away


class _Group(click.Group):
    """Turns engine errors into ``error: ...`` with exit status 2, and a closed stdout into 141."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CheckpointError as e:
            raise _Failed(str(e)) from e
        except BrokenPipeError:
            # The reader (`| head`) has gone: say nothing more, and make sure the interpreter's
            # last flush of what is still buffered does not fail either.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            ctx.exit(PIPE_CLOSED)


class _Failed(click.ClickException):
    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


@click.group(
    cls=_Group,
    commands=[
        status.status,
        inspect.inspect,
        verify.verify,
        compact.compact,
        repair.repair_command,
        clean.clean,
        estimate.estimate,
    ],
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="checkpoint-assets", message="%(prog)s %(version)s")
def cli() -> None:
    """Inspect, verify, compact, repair and clean the checkpoints of checkpointed Dagster assets;
    estimate a run before it starts.

    BASE_DIR is the IO manager's base_dir: a local path or an fsspec URI
    (s3://bucket/checkpoints). NAME is a checkpoint as `status` lists it:
    ASSET/TAG/PARTITION, such as ticket_routing/default/3-of-8. Credentials come from -o
    options or the environment, as for the IO manager.

    Tables and results go to stdout; progress and notes go to stderr.

    Exit status:

    \b
    - 0: all is well.
    - 1: something was found or skipped (verify's problems, a locked checkpoint).
    - 2: an error, said as `error: ...` or `NAME: error: ...` on stderr.
    - 130: interrupted.
    - 141: stdout closed early (| head).
    """


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    try:
        rv = cli.main(
            args=list(argv) if argv is not None else None,
            prog_name="checkpoint-assets",
            standalone_mode=False,
        )
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.Abort as e:
        interrupted = isinstance(e.__cause__, KeyboardInterrupt)
        click.echo("Interrupted." if interrupted else "Aborted.", err=True)
        return 130 if interrupted else 1
    return rv if isinstance(rv, int) else 0
