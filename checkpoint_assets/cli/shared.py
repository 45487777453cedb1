"""What the commands share: their arguments, their output, and the loop of the commands that
change checkpoints (``compact``, ``repair``, ``clean``), each under its lock."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

import click
import polars as pl
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from checkpoint_assets.engine.checkpoints import layout
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.layout import MERGED
from checkpoint_assets.engine.errors import CheckpointError, LockHeldError
from checkpoint_assets.engine.loop.lock import Lease
from checkpoint_assets.engine.rows import CURRENT
from checkpoint_assets.engine.storage import Store, open_store
from checkpoint_assets.engine.storage.errors import translate

T = TypeVar("T")


# -- arguments -------------------------------------------------------------------------------
def _parse_options(
    ctx: click.Context, param: click.Parameter, pairs: Sequence[str]
) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            # Never repeat what was given: it may be a secret typed with the wrong separator.
            raise click.BadParameter(
                "each option must look like KEY=VALUE (such as -o key=value); the one given "
                "is not repeated here, as it may hold a secret",
                ctx,
                param,
            )
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def storage_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The ``-o KEY=VALUE`` option of every command, parsed into ``options``."""
    return click.option(
        "-o",
        "--option",
        "options",
        multiple=True,
        metavar="KEY=VALUE",
        callback=_parse_options,
        help="A storage option of the filesystem (repeatable; VALUE may be JSON), such as "
        "-o endpoint_url=http://127.0.0.1:9000.",
    )(fn)


def existing(base_dir: str, options: dict[str, Any]) -> Store:
    """The store under ``base_dir``, which must exist: a mistyped folder fails the command
    (exit status 2) instead of showing no checkpoints. On an object store, where a prefix with
    nothing under it cannot be told from one that is not there, its bucket must exist."""
    store = open_store(base_dir, options)
    where = store.root if store.local else store.root.split("/", 1)[0]
    with translate(store, where, "listing"):
        found = store.fs.isdir(where)
    if not found:
        shown = store.url if store.local else f"The bucket of {store.url}"
        raise CheckpointError(
            f"{shown} does not exist.",
            "Check the path: give the base_dir of the CheckpointIOManager whose checkpoints "
            "to read.",
        )
    return store


def checkpoint_name(ctx: click.Context, param: click.Parameter, name: str | None) -> str | None:
    """Also accept a name as a path (``.../3-of-8.parquet``, a trailing slash)."""
    return name.strip("/").removesuffix(MERGED) if name else name


def chosen(store: Store, name: str | None) -> list[str]:
    """``[name]`` when given, else every checkpoint under the store (saying so when none)."""
    if name:
        return [name]
    found = layout.names_in((f.path for f in store.list_recursive(store.root)), store.root)
    if not found:
        click.echo(f"No checkpoints under {store.url}.", err=True)
    return found


# -- output ----------------------------------------------------------------------------------
def console() -> Console:
    """Rich output on stdout; markup off, since values (errors, JSON) hold brackets.

    Off a terminal lines are never wrapped, so `grep` and `cut` see one line per row.
    """
    out = Console(markup=False, highlight=False, emoji=False)
    if not out.is_terminal:
        out = Console(markup=False, highlight=False, emoji=False, width=1_000_000)
    return out


def table(*columns: str) -> Table:
    made = Table(box=None, pad_edge=False, header_style="bold", title_justify="left")
    for column in columns:
        made.add_column(column, overflow="fold")
    return made


def when(ts: float | str | None) -> str:
    """A time (seconds since the epoch, or ISO 8601) for people: UTC, to the second."""
    if not ts:
        return "-"
    at = datetime.fromisoformat(ts) if isinstance(ts, str) else datetime.fromtimestamp(ts, UTC)
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds") if ts else None


def echo_lines(lines: Iterable[str], chunk_bytes: int = 2**16) -> None:
    """Print ``lines`` in chunks: few writes for many lines, yet a reader that stops early
    (``| head``) is noticed at once instead of after everything was produced."""
    chunk: list[str] = []
    size = 0
    for line in lines:
        chunk.append(line)
        size += len(line) + 1
        if size >= chunk_bytes:
            click.echo("\n".join(chunk))
            chunk, size = [], 0
    if chunk:
        click.echo("\n".join(chunk))


def short(value: Any, limit: int) -> str:
    text = "null" if value is None else str(value)
    text = text.splitlines()[0] if text else text
    return text if len(text) <= limit else text[: limit - 1] + "…"


def result_rows(rows: pl.DataFrame) -> pl.DataFrame:
    """The rows that form the result (not those kept for ids no longer in the input)."""
    return rows.filter(pl.col(CURRENT).fill_null(True)) if CURRENT in rows.columns else rows


class Steps:
    """Progress over many checkpoints, on stderr: a bar on a terminal, a line each otherwise."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.count = 0
        self.task = progress.add_task("", total=total) if progress else None

    def start(self, name: str) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, description=name)

    def done(self, name: str, state: str, notable: bool = True) -> None:
        """``state`` of ``name``; on a terminal only ``notable`` states get a line."""
        self.count += 1
        if self.progress is None or self.task is None:
            click.echo(f"[{self.count}/{self.total}] {name}: {state}", err=True)
            return
        if notable:
            self.progress.console.print(f"{name}: {state}")
        self.progress.advance(self.task)


@contextmanager
def steps(total: int) -> Iterator[Steps]:
    err = Console(stderr=True, markup=False, highlight=False, emoji=False)
    if not err.is_terminal or total <= 1:
        yield Steps(None, total)
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        # Lines printed on stdout go above the bar when stdout is this terminal too; into a
        # pipe they go unchanged.
        redirect_stdout=sys.stdout.isatty(),
        redirect_stderr=False,
    )
    with progress:
        yield Steps(progress, total)


# -- changing checkpoints, each under its lock -----------------------------------------------
@contextmanager
def locked(checkpoint: Checkpoint) -> Iterator[None]:
    """Hold ``checkpoint``'s lock (``LockHeldError`` when a live run holds it; a dead run's
    lock is taken over)."""
    lease = Lease(checkpoint.store, checkpoint.files.lock)
    lease.acquire()
    try:
        yield
    finally:
        lease.release()


@dataclass
class Handled(Generic[T]):
    """What ``each_under_lock`` did, by checkpoint name (in the order of the names)."""

    done: dict[str, T] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # held by a live run: by whom
    failed: dict[str, str] = field(default_factory=dict)  # what is wrong and what to do

    def tail(self) -> str:
        """What went otherwise, to end a summary ("; skipped 1 held by a live run; 2 failed")."""
        said = [f"skipped {len(self.skipped)} held by a live run"] if self.skipped else []
        said += [f"{len(self.failed)} failed"] if self.failed else []
        return "".join(f"; {s}" for s in said)

    def exit_status(self) -> int:
        """2 when a checkpoint failed, else 1 when one was skipped, else 0."""
        return 2 if self.failed else 1 if self.skipped else 0


def each_under_lock(
    store: Store,
    names: Sequence[str],
    work: Callable[[Checkpoint], T],
    said: Callable[[T], str],
) -> Handled[T]:
    """Run ``work`` on each checkpoint of ``names``; it takes the checkpoint's lock.

    One that a live run holds is skipped. One that fails otherwise (damaged, no meta file) is an
    error, said with what to do; the others are still done. Progress goes to stderr:
    ``said(result)``, or why it was skipped or failed.
    """
    handled: Handled[T] = Handled()
    with steps(len(names)) as progress:
        for name in names:
            progress.start(name)
            try:
                result = work(Checkpoint(store, name))
            except LockHeldError as e:
                progress.done(name, f"skipped: {e}")
                handled.skipped[name] = str(e)
            except CheckpointError as e:
                progress.done(name, f"error: {e}")
                handled.failed[name] = str(e)
            else:
                progress.done(name, said(result), notable=False)
                handled.done[name] = result
    return handled
