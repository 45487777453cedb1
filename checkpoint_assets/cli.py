"""``checkpoint-assets``: look at and look after checkpoints, without Dagster running.

    checkpoint-assets status  BASE_DIR          one row per checkpoint
    checkpoint-assets inspect BASE_DIR NAME     meta, schema, counts and sample rows
    checkpoint-assets verify  BASE_DIR [NAME]   check invariants; exit 1 on any problem
    checkpoint-assets compact BASE_DIR [NAME]   merge unmerged parts (takes the lock)

``BASE_DIR`` is the IO manager's ``base_dir`` (a local path or an fsspec URI); ``NAME`` is a
checkpoint as ``status`` lists it (``ticket_routing/default/3-of-8``). Storage options are given
as ``-o key=value`` (values may be JSON) or come from the environment, as for the IO manager.
"""

from __future__ import annotations

import argparse
import json
import posixpath
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import polars as pl

from checkpoint_assets.engine.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import CheckpointError, LockHeldError
from checkpoint_assets.engine.global_resume import checkpoint_names
from checkpoint_assets.engine.lock import Lease
from checkpoint_assets.engine.rows import CURRENT, ERROR, resolve
from checkpoint_assets.engine.storage import FileInfo, Store, open_store


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        store = open_store(args.base_dir, _options(args.option))
        return int(args.command(store, args))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="checkpoint-assets",
        description="Inspect, verify and compact checkpoints of checkpointed Dagster assets.",
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, fn: Any, help: str, name_arg: str | None) -> None:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("base_dir", metavar="BASE_DIR", help="the IO manager's base_dir")
        if name_arg == "required":
            p.add_argument("name", metavar="NAME", help="checkpoint, as `status` lists it")
        elif name_arg == "optional":
            p.add_argument("name", metavar="NAME", nargs="?", help="one checkpoint (default: all)")
        p.add_argument(
            "-o",
            "--option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a storage option for the filesystem (repeatable; VALUE may be JSON)",
        )
        p.set_defaults(command=fn)

    command("status", status, "One row per checkpoint: rows, parts, size, last write, lock.", None)
    command(
        "inspect", inspect, "Meta, schema, counts and sample rows of one checkpoint.", "required"
    )
    command(
        "verify",
        verify,
        "Check every invariant; exit status 1 when a problem is found.",
        "optional",
    )
    command("compact", compact, "Merge unmerged parts into the merged file.", "optional")
    return parser


def _options(pairs: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise CheckpointError(f"storage option {pair!r} must look like key=value")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _names(store: Store, args: argparse.Namespace) -> list[str]:
    if getattr(args, "name", None):
        return [args.name]
    names = checkpoint_names(store, "")
    if not names:
        print(f"No checkpoints under {store.url}.", file=sys.stderr)
    return names


def _no_meta(store: Store, name: str) -> str:
    return (
        f"No checkpoint {name!r} under {store.url} (no meta file). "
        f"`checkpoint-assets status {store.url}` lists the checkpoints there."
    )


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _split(name: str) -> tuple[str, str, str]:
    parts = name.split("/")
    if len(parts) < 3:
        return name, "-", "-"
    return "/".join(parts[:-2]), parts[-2], parts[-1]


# -- commands ---------------------------------------------------------------------------------
def status(store: Store, args: argparse.Namespace) -> int:
    listing = store.list_recursive(store.root)  # one listing for every checkpoint's files
    names = [args.name] if getattr(args, "name", None) else _names_in(store, listing)
    rows = []
    for name in names:
        checkpoint = Checkpoint(store, name)
        files = [f for f in listing if _belongs(f.path, checkpoint)]
        try:
            meta = checkpoint.read_meta()
            counts: dict[str, Any] = dict(meta.rows) if meta else {}
        except CheckpointError:
            counts = {"ok": "unreadable meta", "failed": "-"}  # `verify` says more
        locked = any(f.path == checkpoint.files.lock for f in files)
        holder = Lease(store, checkpoint.files.lock).read() if locked else None
        asset, tag, partition = _split(name)
        rows.append(
            {
                "asset": asset,
                "tag": tag,
                "partition": partition,
                "rows ok": counts.get("ok", "-"),
                "rows failed": counts.get("failed", "-"),
                "parts": len(checkpoint.list_parts(files)[0]),
                "size": _size(sum(f.size for f in files)),
                "last write": _when(max((f.mtime or 0 for f in files), default=0)),
                "lock": holder.describe() if holder else "-",
            }
        )
    if rows:
        _print_table(rows)
    elif not names:
        print(f"No checkpoints under {store.url}.", file=sys.stderr)
    return 0


def _names_in(store: Store, listing: Sequence[FileInfo]) -> list[str]:
    suffix = ".parquet.meta.json"
    return sorted(
        posixpath.relpath(f.path, store.root)[: -len(suffix)]
        for f in listing
        if f.path.endswith(suffix)
    )


def _belongs(path: str, checkpoint: Checkpoint) -> bool:
    """Is ``path`` one of the checkpoint's files (merged, meta, lock, parts)?"""
    return path == checkpoint.files.merged or path.startswith(checkpoint.files.merged + ".")


def inspect(store: Store, args: argparse.Namespace) -> int:
    checkpoint = Checkpoint(store, args.name)
    meta = checkpoint.read_meta()
    if meta is None:
        raise CheckpointError(_no_meta(store, args.name))
    stored = checkpoint.load(meta.id_column, meta.base_seq)
    rows = stored.rows
    current = rows.filter(pl.col(CURRENT).fill_null(True)) if CURRENT in rows.columns else rows
    print(f"checkpoint   {checkpoint.url}")
    print(f"job          {meta.job_fingerprint}  {json.dumps(meta.job, sort_keys=True)}")
    print(f"scheme       {meta.scheme.label if meta.scheme else '-'}")
    print(f"id column    {meta.id_column} ({meta.id_dtype})")
    print(f"outputs      {json.dumps(meta.output_schema)}")
    print(f"input        {meta.input_fingerprint or '-'}")
    print(f"finalized    {_when(meta.finalized_at)}")
    print(f"parts        {len(stored.parts)} unmerged (watermark {stored.watermark})")
    failed = current.filter(pl.col(ERROR).is_not_null()) if ERROR in current.columns else current
    print(
        f"rows         {rows.height:,} stored, {current.height:,} in the result, "
        f"{failed.height:,} failed"
    )
    if failed.height:
        errors = failed.group_by(ERROR).len().sort("len", descending=True).head(5)
        print("top errors:")
        for error, count in errors.iter_rows():
            print(f"  {count:>8,}  {str(error)[:160]}")
    with pl.Config(tbl_rows=5, tbl_width_chars=120, fmt_str_lengths=40):
        print(current.head(5))
    return 0


def verify(store: Store, args: argparse.Namespace) -> int:
    problems = 0
    names = _names(store, args)
    for i, name in enumerate(names, 1):
        checkpoint = Checkpoint(store, name)
        found = _problems(checkpoint)
        problems += len(found)
        state = "ok" if not found else f"{len(found)} problem(s)"
        print(f"[{i}/{len(names)}] {name}: {state}", file=sys.stderr)
        for problem in found:
            print(f"{name}: {problem}")
    return 1 if problems else 0


def _problems(checkpoint: Checkpoint) -> list[str]:
    try:
        meta = checkpoint.read_meta()
    except CheckpointError as e:
        return [str(e)]
    if meta is None:
        return [_no_meta(checkpoint.store, checkpoint.name)]
    found: list[str] = []
    outputs = list(meta.output_schema or {})
    files: list[tuple[str, pl.DataFrame]] = []
    watermark = 0
    try:
        merged, watermark = checkpoint.read_merged()
        if merged is not None:
            files.append((checkpoint.files.merged, merged))
    except CheckpointError as e:
        found.append(str(e))
    for part in checkpoint.list_parts()[0]:
        if part.last <= watermark:
            continue  # merged already; the next writer deletes it
        try:
            files.append((part.path, checkpoint.read_file(part.path)))
        except CheckpointError as e:
            found.append(str(e))
    frames = []
    for path, frame in files:
        try:
            checkpoint.check_file(frame, meta.id_column, path, outputs)
            frames.append(frame)
        except CheckpointError as e:
            found.append(str(e))
    if frames and not found:
        try:
            resolve(
                frames, meta.id_column, checkpoint.url
            )  # the files agree on their columns and types
        except CheckpointError as e:
            found.append(str(e))
    return found


def compact(store: Store, args: argparse.Namespace) -> int:
    names = _names(store, args)
    skipped = 0
    for i, name in enumerate(names, 1):
        checkpoint = Checkpoint(store, name)
        meta = checkpoint.read_meta()
        if meta is None:
            print(f"[{i}/{len(names)}] {name}: no meta file, skipped", file=sys.stderr)
            skipped += 1
            continue
        lease = Lease(store, checkpoint.files.lock)
        try:
            lease.acquire()
        except LockHeldError as e:
            print(f"[{i}/{len(names)}] {name}: skipped: {e}", file=sys.stderr)
            skipped += 1
            continue
        try:
            stored = checkpoint.load(meta.id_column, meta.base_seq)
            checkpoint.finalize(meta.id_column, None, meta.base_seq, known=stored)
        finally:
            lease.release()
        print(f"[{i}/{len(names)}] {name}: merged {len(stored.parts)} part(s)", file=sys.stderr)
    return 1 if skipped else 0


def _print_table(rows: list[dict[str, Any]]) -> None:
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in columns))


if __name__ == "__main__":
    raise SystemExit(main())
