"""Rows found outside the checkpoint, taken into it before the first call.

- ``take_imported``: global resume's finished rows of other checkpoints of the tag
  (``global_resume.py``), those the input holds with the same input hash.
- ``take_from_store``: the rows left to compute that the result store holds (``from_store.py``).

Both write what they take as one part of the checkpoint, record the output columns in the meta
when it has none, and count the rows on ``Start``. ``opening.py`` calls them.
"""

from __future__ import annotations

import json
import logging

import polars as pl

from checkpoint_assets.engine import rows
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import JobMismatchError
from checkpoint_assets.engine.plan import from_store, function_fingerprint
from checkpoint_assets.engine.plan.global_resume import FUNCTION
from checkpoint_assets.engine.plan.start import Job, Start
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.rows import ATTEMPTS, ERROR, INPUT_HASH, SEQ
from checkpoint_assets.engine.settings import Settings

Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]


def take_imported(
    opened: Start,
    stored: pl.DataFrame,
    imported: pl.DataFrame,
    inputs: pl.DataFrame,
    settings: Settings,
    checkpoint: Checkpoint,
    log: Logger,
    label: str,
) -> pl.DataFrame:
    """Copy matching finished rows of other checkpoints into this one (one part)."""
    id_column = settings.id_column
    wanted = importable(stored, imported, inputs, id_column)
    if wanted.height == 0:
        return stored
    wanted = _note_imported_functions(opened, wanted)
    assert opened.meta is not None
    outputs = {c: str(wanted.schema[c]) for c in rows.outputs_of(wanted, id_column)}
    if not opened.meta.output_schema:
        opened.meta.output_schema = outputs
        checkpoint.meta_file.write(opened.meta)
    elif list(outputs) != list(opened.meta.output_schema):
        raise JobMismatchError(
            checkpoint.url,
            f"The global resume table holds the output columns {list(outputs)}, but the "
            f"checkpoint {checkpoint.url} holds results with {list(opened.meta.output_schema)}.",
        )
    found = wanted.with_columns(
        pl.lit(None, pl.String).alias(ERROR), pl.col(ATTEMPTS).fill_null(0).cast(pl.Int32)
    )
    _write(opened, found, id_column, checkpoint)
    opened.imported = found.height
    log.info(
        "%s: global resume took %d finished row(s) from other checkpoints.", label, found.height
    )
    merged = rows.concat([stored, found], checkpoint.url) if stored.height else found
    return rows.pick_winners(merged, id_column)


def _write(start: Start, found: pl.DataFrame, id_column: str, checkpoint: Checkpoint) -> None:
    """Write rows found elsewhere (global resume, the result store) as one part."""
    seq = start.next_seq
    part = checkpoint.write_part(
        found.with_columns(pl.lit(seq, pl.Int64).alias(SEQ)), seq, id_column=id_column
    )
    start.next_seq += 1
    start.known = None
    start.parts = checkpoint.compact([*start.parts, part], id_column)


def take_from_store(
    start: Start,
    todo: pl.DataFrame,
    results: ResultStore,
    job: Job,
    settings: Settings,
    checkpoint: Checkpoint,
    log: Logger,
    label: str,
) -> tuple[pl.DataFrame, pl.Series | None]:
    """Take the rows of ``todo`` the result store holds into the checkpoint; the rest of
    ``todo``, in its order, and the ids taken (None: none)."""
    if not job.function:
        log.warning(
            "%s: the function has no fingerprint (no readable source or bytecode), so the "
            "result store is not used: it could hand over another function's results.",
            label,
        )
        return todo, None
    id_column = settings.id_column
    taken = from_store.take(
        todo, results, job.scope, id_column, settings.budget, parse=job.parse, label=label
    )
    for path in results.unreadable:
        log.warning(
            "%s: the result store file %s is unreadable; its rows are computed again. Delete "
            "it (`checkpoint-assets clean --results`) or move it away.",
            label,
            path,
        )
    if taken is None:
        return todo, None
    assert start.meta is not None
    outputs = {c: str(taken.rows.schema[c]) for c in rows.outputs_of(taken.rows, id_column)}
    known = start.meta.output_schema
    if not from_store.fits(taken.rows, known, id_column):
        log.warning(
            "%s: the result store holds results with the output columns %s, but the checkpoint "
            "holds %s; they are not taken.",
            label,
            sorted(outputs),
            sorted(known or {}),
        )
        return todo, None
    if not known:
        start.meta.output_schema = outputs
        checkpoint.meta_file.write(start.meta)
    _write(start, taken.rows, id_column, checkpoint)
    start.from_store, start.cost_saved = taken.rows.height, taken.cost_saved
    _log_taken(taken.rows, results.url, log, label)
    ids = taken.rows.get_column(id_column)
    return todo.filter(~pl.col(id_column).is_in(ids.implode())), ids


def _log_taken(taken: pl.DataFrame, url: str, log: Logger, label: str) -> None:
    log.info(
        "%s: took %d result(s) from the result store %s instead of computing them.",
        label,
        taken.height,
        url,
    )
    failed = int(taken.get_column(ERROR).is_not_null().sum())
    if failed:
        log.warning(
            "%s: parse() raised for %d stored answer(s) taken from the result store: they are "
            "failed rows, with parse()'s error. Fix parse(); the next run parses them again.",
            label,
            failed,
        )


def importable(
    stored: pl.DataFrame, imported: pl.DataFrame, inputs: pl.DataFrame, id_column: str
) -> pl.DataFrame:
    """The rows of ``imported`` (other checkpoints' finished rows) that the input ``inputs``
    has, with the same input hash, and that ``stored`` does not hold as done."""
    if id_column not in imported.columns or imported.height == 0:
        return imported.clear()
    imported = imported.with_columns(pl.col(id_column).cast(inputs.schema[id_column]))
    # Membership tests hold a third of what a join on both columns does (130 against 370 MB at
    # 2M rows).
    key = pl.struct(id_column, INPUT_HASH)
    wanted = imported.filter(key.is_in(_keys(inputs, key)))
    if stored.height:
        wanted = wanted.filter(~key.is_in(_keys(stored.filter(pl.col(ERROR).is_null()), key)))
    return wanted


def _keys(frame: pl.DataFrame, key: pl.Expr) -> pl.Series:
    """``key`` of every row of ``frame``, as one list for ``is_in``."""
    return frame.select(key.alias("__key")).get_column("__key").implode()


def _note_imported_functions(opened: Start, wanted: pl.DataFrame) -> pl.DataFrame:
    """Add what differs between the functions that computed the imported rows (recorded by
    their checkpoints) and this run's to ``opened.function_changed``; drop their column."""
    if FUNCTION not in wanted.columns:
        return wanted  # a global resume table of an earlier version
    if opened.function_fingerprint:
        # Distinct first: one text per checkpoint, not one per row.
        for text in wanted.get_column(FUNCTION).unique().cast(pl.String).drop_nulls().sort():
            recorded = json.loads(text)
            found = function_fingerprint.changes(recorded, opened.function_fingerprint)
            opened.function_changed += [c for c in found if c not in opened.function_changed]
            changed = function_fingerprint.request_changed(recorded, opened.function_fingerprint)
            opened.request_changed = opened.request_changed or changed
    return wanted.drop(FUNCTION)
