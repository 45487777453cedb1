"""``checkpoint-assets``: look at and look after checkpoints, without Dagster running.

    checkpoint-assets status  [BASE_DIR] [--json]      one row per checkpoint
    checkpoint-assets inspect BASE_DIR NAME [--failed] meta, schema, counts, errors, sample rows
    checkpoint-assets verify  BASE_DIR [NAME]          check invariants; exit 1 on any problem
    checkpoint-assets compact BASE_DIR [NAME]          merge unmerged parts (takes the lock)
    checkpoint-assets repair  BASE_DIR [NAME] [--json] rebuild from what is readable, damaged
                                                       files kept aside (takes the lock)
    checkpoint-assets clean   BASE_DIR --tag TAG       delete the checkpoints of a tag

``BASE_DIR`` is the IO manager's ``base_dir`` (a local path or an fsspec URI); ``NAME`` is a
checkpoint as ``status`` lists it (``ticket_routing/default/3-of-8``). Storage options are given
as ``-o key=value`` (values may be JSON) or come from the environment, as for the IO manager.

Results go to stdout (tables, or JSON and ids for scripts); progress and notes go to stderr: a
progress bar on a terminal, one line per checkpoint otherwise. Exit status: 0 when all is well,
1 when something was found or skipped, 2 on an error (``error: ...`` on stderr), 141 when stdout
is closed early (``| head``), as for other command-line tools.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import click
import polars as pl
from rich.console import Console
from rich.filesize import decimal
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from checkpoint_assets.engine import layout
from checkpoint_assets.engine.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import CheckpointError, LockHeldError
from checkpoint_assets.engine.layout import MERGED, split_name
from checkpoint_assets.engine.lock import Lease
from checkpoint_assets.engine.meta import Meta
from checkpoint_assets.engine.repair import Repaired, repair
from checkpoint_assets.engine.rows import BOOKKEEPING, CURRENT, ERROR
from checkpoint_assets.engine.storage import FileInfo, LocalStore, Store, open_store
from checkpoint_assets.engine.verify import problems

PIPE_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away
SAMPLE_ROWS = 5
TOP_ERRORS = 10
SAMPLE_IDS = 3
STATUS_READERS = 16  # checkpoints `status` reads at once


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
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
def cli() -> None:
    """Inspect, verify, compact, repair and clean the checkpoints of checkpointed Dagster assets.

    BASE_DIR is the IO manager's base_dir: a local path or an fsspec URI
    (s3://bucket/checkpoints). NAME is a checkpoint as `status` lists it:
    ASSET/TAG/PARTITION, such as ticket_routing/default/3-of-8.
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


# -- shared arguments ------------------------------------------------------------------------
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


def _storage_options(fn: Callable[..., Any]) -> Callable[..., Any]:
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


def _checkpoint_name(ctx: click.Context, param: click.Parameter, name: str | None) -> str | None:
    """Also accept a name as a path (``.../3-of-8.parquet``, a trailing slash)."""
    return name.strip("/").removesuffix(MERGED) if name else name


def _names(store: Store, name: str | None) -> list[str]:
    if name:
        return [name]
    names = layout.names_in((f.path for f in store.list_recursive(store.root)), store.root)
    if not names:
        click.echo(f"No checkpoints under {store.url}.", err=True)
    return names


# -- output helpers --------------------------------------------------------------------------
def _console() -> Console:
    """Rich output on stdout; markup off, since values (errors, JSON) hold brackets.

    Off a terminal lines are never wrapped, so `grep` and `cut` see one line per row.
    """
    console = Console(markup=False, highlight=False, emoji=False)
    if not console.is_terminal:
        console = Console(markup=False, highlight=False, emoji=False, width=1_000_000)
    return console


def _table(*columns: str) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _when(ts: float | str | None) -> str:
    """A time (seconds since the epoch, or ISO 8601) for people: UTC, to the second."""
    if not ts:
        return "-"
    when = datetime.fromisoformat(ts) if isinstance(ts, str) else datetime.fromtimestamp(ts, UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _iso(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds") if ts else None


def _echo_lines(lines: Iterable[str], chunk_bytes: int = 2**16) -> None:
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


def _short(value: Any, limit: int) -> str:
    text = "null" if value is None else str(value)
    text = text.splitlines()[0] if text else text
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _Steps:
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
def _steps(total: int) -> Iterator[_Steps]:
    err = Console(stderr=True, markup=False, highlight=False, emoji=False)
    if not err.is_terminal or total <= 1:
        yield _Steps(None, total)
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
        yield _Steps(progress, total)


# -- status ----------------------------------------------------------------------------------
@cli.command(short_help="One row per checkpoint: rows, parts, size, lock.")
@click.argument("base_dir", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, for scripts.")
@_storage_options
def status(base_dir: str | None, as_json: bool, options: dict[str, Any]) -> None:
    """One row per checkpoint: rows ok and failed, parts, size, last write, lock holder, usage.

    BASE_DIR defaults to $DAGSTER_HOME/checkpoints, the IO manager's default. Rows are counted
    in unmerged parts too (a run that was interrupted before it finished). Usage is the sum of
    each of the asset's usage_columns over the stored rows (tokens, cost).

    With --json each checkpoint is an object with asset, tag, partition, rows_ok, rows_failed,
    parts, bytes, last_write (ISO 8601, UTC), lock (the holder, or null), lock_stale (why the
    holder is dead, so that the next writer takes the lock over, or null), usage (column: sum)
    and error (why the checkpoint could not be read, or null).
    """
    if base_dir is None:
        home = os.environ.get("DAGSTER_HOME")
        if not home:
            raise click.UsageError(
                "Give BASE_DIR (the IO manager's base_dir), or set DAGSTER_HOME to list "
                "$DAGSTER_HOME/checkpoints."
            )
        base_dir = os.path.join(home, "checkpoints")
    store = open_store(base_dir, options)
    listing = store.list_recursive(store.root)  # one listing for every checkpoint's files
    by_name = layout.files_by_name(((f.path, f) for f in listing), store.root)
    # Each checkpoint costs a request or more (its meta; parts and lock when it has them): read
    # one after the other, a thousand shards on an object store would take a thousand round trips.
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
    table = _table(*columns, *(["usage"] if with_usage else []))
    for s in summaries:
        counts = ["?", "?"] if s["error"] else [f"{s['rows_ok']:,}", f"{s['rows_failed']:,}"]
        usage = ", ".join(f"{c} {v:,.6g}" for c, v in s["usage"].items()) or "-"
        table.add_row(
            s["asset"],
            s["tag"],
            s["partition"],
            *counts,
            str(s["parts"]),
            decimal(s["bytes"]),
            _when(s["last_write"]),
            (f"{s['lock']} (stale: {s['lock_stale']})" if s["lock_stale"] else s["lock"]) or "-",
            *([usage] if with_usage else []),
        )
    _console().print(table)
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
        meta = checkpoint.read_meta()
        if meta is None:
            raise CheckpointError(f"No checkpoint {name!r} under {store.url} (no meta file).")
        usage = dict(meta.usage)  # the usage_columns' sums at the last finalize
        if not parts and meta.finalized_at is not None and "ok" in meta.rows:
            ok, failed = meta.rows["ok"], meta.rows.get("failed", 0)
        else:  # rows of a run that did not finish are only in its parts
            stored = checkpoint.load(meta.id_column, meta.base_seq)
            ok, failed = _counts(stored.rows)
            parts = stored.parts
            current = _current(stored.rows)
            usage = {c: float(current.get_column(c).sum() or 0) for c in usage if c in current}
    except CheckpointError as e:
        error = str(e)
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
        "last_write": _iso(max((f.mtime or 0 for f in files), default=0)),
        "lock": holder.describe() if holder else None,
        "lock_stale": stale,
        "usage": usage,
        "error": error,
    }


def _current(rows: pl.DataFrame) -> pl.DataFrame:
    """The rows that form the result (not those kept for ids no longer in the input)."""
    return rows.filter(pl.col(CURRENT).fill_null(True)) if CURRENT in rows.columns else rows


def _counts(rows: pl.DataFrame) -> tuple[int, int]:
    """(ok, failed) rows of the result."""
    current = _current(rows)
    failed = int(current.get_column(ERROR).is_not_null().sum()) if ERROR in current.columns else 0
    return current.height - failed, failed


# -- inspect ---------------------------------------------------------------------------------
@cli.command(short_help="Meta, schema, counts, top errors, sample rows.")
@click.argument("base_dir")
@click.argument("name", callback=_checkpoint_name)
@click.option("--failed", is_flag=True, help="Print only the ids of failed rows, one per line.")
@_storage_options
def inspect(base_dir: str, name: str, failed: bool, options: dict[str, Any]) -> None:
    """Meta, schema, counts, most common errors and sample rows of one checkpoint."""
    store = open_store(base_dir, options)
    checkpoint = Checkpoint(store, name)
    meta = checkpoint.read_meta()
    if meta is None:
        raise CheckpointError(
            f"No checkpoint {name!r} under {store.url} (no meta file). "
            f"`checkpoint-assets status {store.url}` lists the checkpoints there."
        )
    stored = checkpoint.load(meta.id_column, meta.base_seq)
    current = _current(stored.rows)
    errors = current.filter(pl.col(ERROR).is_not_null()) if ERROR in current.columns else None
    if failed:
        if errors is not None and errors.height:
            _echo_lines(str(i) for i in errors.get_column(meta.id_column).sort())
        return
    console = _console()
    n_failed = errors.height if errors is not None else 0
    old = stored.rows.height - current.height
    gone = f"; {old:,} more stored for ids no longer in the input" if old else ""
    for key, value in [
        ("checkpoint", checkpoint.url),
        ("job", f"{meta.job_fingerprint}  {json.dumps(meta.job, sort_keys=True)}"),
        ("scheme", meta.scheme.label if meta.scheme else "-"),
        ("input", f"{meta.input_fingerprint or '-'}  (input hash format {meta.input_hash_format})"),
        ("finalized", _when(meta.finalized_at)),
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
    table = _table("column", "type", "role")
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
    table = _table("rows", "error", "sample ids")
    table.title = f"most common errors ({top.height} distinct)"
    for error, count, ids in top.head(TOP_ERRORS).iter_rows():
        table.add_row(f"{count:,}", _short(error, 300), ", ".join(_short(i, 40) for i in ids))
    return table


def _sample(current: pl.DataFrame, id_column: str) -> Table:
    shown = [c for c in current.columns if c not in BOOKKEEPING or c == ERROR]
    table = _table(*shown)
    table.title = f"sample rows (first {min(SAMPLE_ROWS, current.height)} of {current.height:,})"
    for row in current.select(shown).head(SAMPLE_ROWS).iter_rows():
        table.add_row(*(_short(v, 60) for v in row))
    return table


# -- verify ----------------------------------------------------------------------------------
@cli.command(short_help="Check invariants; exit status 1 on any problem.")
@click.argument("base_dir")
@click.argument("name", required=False, callback=_checkpoint_name)
@_storage_options
def verify(base_dir: str, name: str | None, options: dict[str, Any]) -> int:
    """Check every invariant of one checkpoint, or of all; exit status 1 on any problem.

    Readable meta, merged file and parts; the id column in each, of the recorded type, with
    unique ids; output columns where there are results; files that agree on their columns.
    Each problem is printed as `NAME: problem` on stdout.
    """
    store = open_store(base_dir, options)
    names = _names(store, name)
    bad = 0
    with _steps(len(names)) as steps:
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


# -- compact ---------------------------------------------------------------------------------
@cli.command(short_help="Merge unmerged parts, under each lock.")
@click.argument("base_dir")
@click.argument("name", required=False, callback=_checkpoint_name)
@_storage_options
def compact(base_dir: str, name: str | None, options: dict[str, Any]) -> int:
    """Merge the unmerged parts of one checkpoint, or of all, into their merged file.

    Each checkpoint is compacted under its lock; one that a live run holds is skipped, and the
    exit status is then 1.
    """
    store = open_store(base_dir, options)
    names = _names(store, name)
    skipped = merged = 0
    with _steps(len(names)) as steps:
        for each in names:
            steps.start(each)
            try:
                count = _compact_one(Checkpoint(store, each))
            except CheckpointError as e:
                steps.done(each, f"skipped: {e}")
                skipped += 1
                continue
            merged += count
            steps.done(each, f"merged {count} part(s)", notable=False)
    if names:
        click.echo(
            f"Merged {merged} part(s) in {len(names) - skipped} checkpoint(s)"
            + (f"; skipped {skipped}." if skipped else "."),
            err=True,
        )
    return 1 if skipped else 0


def _compact_one(checkpoint: Checkpoint) -> int:
    """Merge the parts of ``checkpoint`` under its lock; returns how many were merged."""
    meta = checkpoint.read_meta()
    if meta is None:
        raise CheckpointError("it has no meta file")
    lease = Lease(checkpoint.store, checkpoint.files.lock)
    lease.acquire()
    try:
        stored = checkpoint.load(meta.id_column, meta.base_seq)
        checkpoint.finalize(meta.id_column, None, meta.base_seq, known=stored)
    finally:
        lease.release()
    return len(stored.parts)


# -- repair ----------------------------------------------------------------------------------
@cli.command("repair", short_help="Rebuild from what is readable; damaged files kept aside.")
@click.argument("base_dir")
@click.argument("name", required=False, callback=_checkpoint_name)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, for scripts.")
@_storage_options
def repair_command(base_dir: str, name: str | None, as_json: bool, options: dict[str, Any]) -> int:
    """Rebuild one checkpoint, or all, from what is readable, under each lock.

    Damaged files (what `verify` flags: unreadable or inconsistent merged file and parts) are
    moved aside to NAME.parquet.quarantine/, never deleted; what is left is merged into a new
    merged file, and the next run computes the rows lost with them. A checkpoint whose meta
    file is unreadable or missing cannot be rebuilt (the meta file is the only record of the job
    that wrote the rows): all its files are moved aside and the next run starts it again. Stale
    temporary files of killed writes are deleted. A checkpoint a live run holds is skipped (exit
    status 1). NAME is needed for a checkpoint without a meta file, which is not listed.

    Each file moved aside is printed as `NAME: moved FILE to QUARANTINED (problem)`, then
    `NAME: what was done`. With --json each checkpoint is an object with name, moved (list of
    path, to, problem), removed_temporary, parts_merged, rows_ok, rows_failed, meta_lost (why
    the meta file could not be used, or null) and skipped (why it was not repaired, or null).
    """
    store = open_store(base_dir, options)
    names = _names(store, name)
    reports: list[dict[str, Any]] = []
    skipped = 0
    with _steps(len(names)) as steps:
        for each in names:
            steps.start(each)
            try:
                done = repair(Checkpoint(store, each))
            except LockHeldError as e:
                steps.done(each, f"skipped: {e}")
                reports.append({"name": each, "skipped": str(e)})
                skipped += 1
                continue
            reports.append({**_repaired(done), "skipped": None})
            if not as_json:
                for moved in done.moved:
                    click.echo(f"{each}: moved {moved.path} to {moved.to} ({moved.problem})")
                click.echo(f"{each}: {done.summary()}")
            steps.done(each, "repaired", notable=False)
    if as_json:
        click.echo(json.dumps(reports, indent=2))
    if names:
        click.echo(
            f"Repaired {len(names) - skipped} checkpoint(s)"
            + (f"; skipped {skipped} held by a live run." if skipped else "."),
            err=True,
        )
    return 1 if skipped else 0


def _repaired(done: Repaired) -> dict[str, Any]:
    return {
        "name": done.name,
        "moved": [{"path": m.path, "to": m.to, "problem": m.problem} for m in done.moved],
        "removed_temporary": done.removed_temporary,
        "parts_merged": done.parts_merged,
        "rows_ok": done.rows_ok,
        "rows_failed": done.rows_failed,
        "meta_lost": done.meta_lost,
    }


# -- clean -----------------------------------------------------------------------------------
@cli.command(short_help="Delete the checkpoints of a tag.")
@click.argument("base_dir")
@click.option("--tag", required=True, help="The checkpoint tag whose checkpoints to delete.")
@click.option("--asset", help="Only the checkpoints of this asset (as `status` shows it).")
@click.option("--yes", is_flag=True, help="Delete without asking.")
@_storage_options
def clean(base_dir: str, tag: str, asset: str | None, yes: bool, options: dict[str, Any]) -> int:
    """Delete every checkpoint of a tag: merged file, parts, meta and lock.

    Asks first on a terminal; elsewhere it deletes only with --yes. A checkpoint that a live
    run holds is skipped (exit status 1); a lock left by a dead run is taken over.
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
    deleted: list[FileInfo] = []
    skipped = 0
    with _steps(len(names)) as steps:
        for each in names:
            steps.start(each)
            try:
                gone = _delete(Checkpoint(store, each))
            except LockHeldError as e:
                steps.done(each, f"skipped: {e}")
                skipped += 1
                continue
            deleted += gone
            steps.done(each, f"deleted {len(gone)} file(s)", notable=False)
    click.echo(
        f"Deleted {len(names) - skipped} checkpoint(s) of {of}: {len(deleted)} files, "
        f"{decimal(sum(f.size for f in deleted))}."
        + (f" Skipped {skipped} held by a live run." if skipped else "")
    )
    return 1 if skipped else 0


def _delete(checkpoint: Checkpoint) -> list[FileInfo]:
    """Delete every file of ``checkpoint`` under its lock, the meta last and then the lock."""
    lease = Lease(checkpoint.store, checkpoint.files.lock)
    lease.acquire()
    try:
        # Listed under the lock: nothing can be added any more.
        files = [f for f in checkpoint.list_files() if f.path != checkpoint.files.lock]
        checkpoint.store.delete(f.path for f in files if f.path != checkpoint.files.meta)
        # Without its meta a checkpoint is no longer listed: deleted last, nothing is orphaned.
        checkpoint.store.delete(f.path for f in files if f.path == checkpoint.files.meta)
    finally:
        lease.release()
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


if __name__ == "__main__":
    raise SystemExit(main())
