"""Opening a run: check the stored job, load what is stored, start a generation, import finished
rows of other checkpoints (global resume), plan what is left to compute, and take what the result
store holds of it (both taken by ``found.py``).

When only how answers are read changed (a request/parse job's ``parse``, see
``function_fingerprint.py``), the stored rows with an answer are not computed again: ``Rederive``
hands them to the work loop, which parses them again (``providers/answers.py``).

``open_run`` returns an ``Opened`` value; nothing here keeps state between runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import polars as pl

from checkpoint_assets.engine import rows
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint, Stored
from checkpoint_assets.engine.checkpoints.meta import Meta
from checkpoint_assets.engine.errors import (
    CorruptCheckpointError,
    JobChangedError,
    JobMismatchError,
)
from checkpoint_assets.engine.plan import found as found_rows
from checkpoint_assets.engine.plan import function_fingerprint
from checkpoint_assets.engine.plan.inputs import Prepared
from checkpoint_assets.engine.plan.resume import Copies, Plan, dedupe, plan
from checkpoint_assets.engine.plan.start import Job, Start
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.rows import ANSWER, ATTEMPTS, CURRENT, ERROR, INPUT_HASH, SEQ
from checkpoint_assets.engine.settings import OnInputChange, Settings
from checkpoint_assets.engine.sharding.scheme import Scheme, rule_changed

Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]


@dataclass(frozen=True)
class Rederive:
    """The stored rows of a job whose ``parse`` changed, for a new generation that holds them
    all: those to parse again, those copied as they are, and the finished ones without answer."""

    answered: pl.DataFrame  # id, input hash, attempts, answer: input unchanged, answer kept
    carried: pl.DataFrame  # every other stored row (bookkeeping but ``_seq`` included)
    unanswered: pl.DataFrame  # rows of the input's keys, with ``_attempts``: no answer kept


@dataclass(kw_only=True)
class Opened(Start):
    """What a run starts from, and what it has to compute."""

    plan: Plan
    todo: pl.DataFrame  # the rows to call the function on (one per distinct input with dedupe)
    copies: Copies | None = None  # rows that take the result of a row in ``todo`` (dedupe)
    rederive: Rederive | None = None  # the parse changed: stored answers to parse again


def open_run(
    inputs: Prepared,
    settings: Settings,
    checkpoint: Checkpoint | None,
    *,
    job: Job,
    scheme: Scheme | None,
    imported: pl.DataFrame | None,
    log: Logger,
    label: str,
    results: ResultStore | None = None,
) -> Opened:
    """Everything a run needs before its first call (``checkpoint`` None: checkpointing off).

    ``results``: the result store, whose results the rows left to compute take when it holds
    them (with checkpointing and resume only)."""
    keys = inputs.keys
    start, stored = Start(function_fingerprint=job.function), rows.empty(settings.id_column)
    if checkpoint is not None:
        importing = imported is not None
        start, stored, reshard = _load(keys, settings, checkpoint, job, scheme, importing, log)
        if imported is not None and settings.resume:
            stored = found_rows.take_imported(
                start, stored, imported, keys, settings, checkpoint, log, label
            )
        if reshard and start.meta is not None:
            start.meta.scheme = scheme  # its rows are resharded now: record the current rule
            checkpoint.meta_file.write(start.meta)
    found = plan_rows(inputs, settings, stored, start.meta)
    _log_plan(found, log, label)
    todo, copies, rederive = found.todo, None, None
    if start.parse_changed and stored.height:
        rederive = _rederive(stored, keys, settings.id_column)
        answered = rederive.answered.get_column(settings.id_column)
        todo = todo.filter(~pl.col(settings.id_column).is_in(answered.implode()))
    if start.function_changed and (found.resumed or rederive is not None):
        if start.request_changed:  # a changed parse alone is the work loop's to tell
            _log_function_changed(start.function_changed, found.resumed, log, label)
    else:
        start.function_changed = []  # no stored result of the earlier function is used
    # A run that re-derives a changed parse starts a new generation after its first parts: it
    # takes nothing from the store (rows it wrote before that generation would be left out).
    if results is not None and checkpoint is not None and settings.resume and rederive is None:
        todo, taken = found_rows.take_from_store(
            start, todo, results, job, settings, checkpoint, log, label
        )
        if taken is not None:
            found.todo = found.todo.filter(~pl.col(settings.id_column).is_in(taken.implode()))
    if settings.dedupe and todo.height:
        todo, copies = dedupe(todo, settings.id_column)
    return Opened(**vars(start), plan=found, todo=todo, copies=copies, rederive=rederive)


def _rederive(stored: pl.DataFrame, keys: pl.DataFrame, id_column: str) -> Rederive:
    """Split ``stored`` for a changed ``parse``: rows with an answer whose input is unchanged
    (or gone from the input), and the rest; and the finished rows of the input without one."""
    now = keys.select(id_column, pl.col(INPUT_HASH).alias("__now"))
    answer = pl.col(ANSWER) if ANSWER in stored.columns else pl.lit(None, pl.String)
    joined = stored.with_columns(answer.alias(ANSWER)).join(
        now, on=id_column, how="left", maintain_order="left"
    )
    unchanged = pl.col("__now").is_null() | (pl.col("__now") == pl.col(INPUT_HASH))
    again = unchanged & pl.col(ANSWER).is_not_null()
    unanswered = joined.filter(
        (pl.col("__now") == pl.col(INPUT_HASH)) & pl.col(ERROR).is_null() & pl.col(ANSWER).is_null()
    ).select(id_column, ATTEMPTS)
    return Rederive(
        answered=joined.filter(again).select(id_column, INPUT_HASH, ATTEMPTS, ANSWER),
        carried=joined.filter(~again).drop("__now", SEQ, CURRENT, strict=False),
        unanswered=keys.join(unanswered, on=id_column, how="inner", maintain_order="left"),
    )


def plan_rows(
    inputs: Prepared, settings: Settings, stored: pl.DataFrame, meta: Meta | None
) -> Plan:
    """The plan of ``inputs`` against the ``stored`` rows of a checkpoint with ``meta``."""
    earlier_hashes = meta is not None and meta.input_hash_format < 2
    return plan(
        inputs.keys,
        stored,
        settings.id_column,
        resume=settings.resume,
        retry_failed=settings.retry_failed,
        on_input_change=OnInputChange(settings.on_input_change),
        earlier_hashes=inputs.earlier_hashes if earlier_hashes else None,
    )


@dataclass(frozen=True)
class Found:
    """What a checkpoint holds for a run, read without writing: its meta, its files loaded,
    whether the run uses its rows (``resume`` and the same job), and its shard rule's change."""

    meta: Meta | None
    loaded: Stored
    same_job: bool
    reshard: bool


def read_stored(
    keys: pl.DataFrame,
    settings: Settings,
    checkpoint: Checkpoint,
    job: Job,
    scheme: Scheme | None,
    *,
    importing: bool,
    quarantine: Logger | None = None,
) -> Found:
    """Read the checkpoint for a run over ``keys``; raises what would stop the run: another
    job's checkpoint, a missing meta file, a changed shard rule without global resume
    (``importing``). ``quarantine``: the caller holds the lock (``Checkpoint.load``)."""
    id_column = settings.id_column
    meta = checkpoint.meta_file.read()
    if meta is not None:
        id_dtype = str(keys.schema[id_column])
        _check_job(meta, job, id_column, id_dtype, settings.resume, checkpoint.url)
    same_job = meta is not None and meta.job_fingerprint == job.fingerprint
    outputs = list(meta.output_schema) if meta and same_job and meta.output_schema else None
    # Under the lock, unreadable parts are moved aside, and their rows computed again.
    base_seq = meta.base_seq if meta else 0
    loaded = checkpoint.load(id_column, base_seq, outputs, quarantine=quarantine)
    if meta is None and loaded.files:
        raise checkpoint.meta_file.missing(loaded.files)
    # A new generation (resume: false, another job) records the current rule.
    used = meta is not None and settings.resume and same_job
    reshard = used and meta is not None and rule_changed(meta.scheme, scheme)
    if reshard and not importing:
        raise _rule_changed_error(checkpoint, meta, scheme)
    if used and meta is not None and meta.output_schema and loaded.rows.height:
        _check_stored_columns(loaded.rows, list(meta.output_schema), checkpoint.url)
    return Found(meta, loaded, same_job, reshard)


def _load(
    keys: pl.DataFrame,
    settings: Settings,
    checkpoint: Checkpoint,
    job: Job,
    scheme: Scheme | None,
    importing: bool,
    log: Logger,
) -> tuple[Start, pl.DataFrame, bool]:
    """Check the stored job and load its rows: where the run starts, the stored rows it uses
    (none, in a new generation, when they are not to be used), and whether its rule changed."""
    id_column = settings.id_column
    id_dtype = str(keys.schema[id_column])
    found = read_stored(
        keys, settings, checkpoint, job, scheme, importing=importing, quarantine=log
    )
    meta, loaded = found.meta, found.loaded
    if meta is not None and (not settings.resume or not found.same_job):
        # resume: false ignores what is stored (which may even be another job's, with other
        # output columns): start a new generation.
        meta = _new_meta(job, id_column, id_dtype, scheme, base_seq=loaded.next_seq)
        checkpoint.meta_file.write(meta)
        start = Start(
            meta=meta,
            base_seq=loaded.next_seq,
            next_seq=loaded.next_seq,
            parts=list(loaded.parts),
            function_fingerprint=job.function,
        )
        return start, loaded.rows.clear(), False
    if meta is None:
        meta = _new_meta(job, id_column, id_dtype, scheme, base_seq=0)
        checkpoint.meta_file.write(meta)
    recorded = meta.function_fingerprint
    start = Start(
        meta=meta,
        known=loaded,
        base_seq=meta.base_seq,
        next_seq=loaded.next_seq,
        parts=list(loaded.parts),
        function_fingerprint=job.function,
    )
    if recorded and job.function:
        start.function_changed = function_fingerprint.changes(recorded, job.function)
        start.parse_changed = function_fingerprint.parse_changed(recorded, job.function)
        start.request_changed = function_fingerprint.request_changed(recorded, job.function)
    return start, loaded.rows, found.reshard


def _new_meta(
    job: Job, id_column: str, id_dtype: str, scheme: Scheme | None, *, base_seq: int
) -> Meta:
    """The meta of a new generation of the checkpoint, starting at flush ``base_seq``."""
    return Meta(
        job_fingerprint=job.fingerprint,
        job=dict(job.settings),
        id_column=id_column,
        id_dtype=id_dtype,
        scheme=scheme,
        base_seq=base_seq,
        function_fingerprint=dict(job.function) if job.function else None,
    )


def _check_job(
    meta: Meta, job: Job, id_column: str, id_dtype: str, resume: bool, where: str
) -> None:
    if meta.id_column != id_column or (meta.job_fingerprint != job.fingerprint and resume):
        keys = sorted(set(meta.job) | set(job.settings))
        changed = {
            k: (meta.job.get(k), job.settings.get(k))
            for k in keys
            if meta.job.get(k) != job.settings.get(k)
        }
        raise JobChangedError(where, changed or {"id_column": (meta.id_column, id_column)})
    if meta.id_dtype != id_dtype and resume:
        error = JobMismatchError(
            where,
            f"Checkpoint {where} stores ids of type {meta.id_dtype}, but the input's "
            f"{id_column!r} is {id_dtype}.",
        )
        raise error.advise(
            f"Cast the id column back to {meta.id_dtype}, or use a new checkpoint tag."
        )


def _rule_changed_error(
    checkpoint: Checkpoint, meta: Meta | None, scheme: Scheme | None
) -> JobMismatchError:
    old = meta.scheme.label if meta and meta.scheme else "another rule"
    new = scheme.label if scheme else "shards"
    error = JobMismatchError(
        checkpoint.url,
        f"Checkpoint {checkpoint.url} holds the rows of its shard by an earlier shard rule "
        f"({old}); this shard now takes its rows by the range rule ({new}), so most of its "
        "finished rows sit in other checkpoints and would be computed again.",
    )
    error.advise(
        "Move them like any reshard: materialize the asset's global resume table, then run "
        "every shard once with `global_resume: true`; nothing finished is computed again."
    )
    return error


def _check_stored_columns(stored: pl.DataFrame, outputs: list[str], where: str) -> None:
    missing = [c for c in outputs if c not in stored.columns]
    if missing and stored.filter(pl.col(ERROR).is_null()).height:
        raise CorruptCheckpointError(where, f"lacks the output columns {missing}")


def _log_function_changed(changed: list[str], resumed: int, log: Logger, label: str) -> None:
    log.warning(
        "%s: the function changed since its stored results were computed (%s), but the job's "
        "code version did not: %d stored result(s) of the earlier function are kept and only "
        "the rest is computed with the new one. To recompute everything, set or bump the code "
        "version (the asset's `code_version`) and run with `resume: false` or a new checkpoint "
        "tag; to keep the stored results, nothing to do: once this run finishes, the checkpoint "
        "records the new function and the next run is quiet.",
        label,
        ", ".join(changed),
        resumed,
    )


def _log_plan(p: Plan, log: Logger, label: str) -> None:
    if p.dropped:
        log.warning(
            "%s: %d stored row(s) are not in the input and are left out of the result "
            "(they stay stored and come back if their ids return).",
            label,
            p.dropped,
        )
    if p.changed:
        log.warning("%s: recomputing %d row(s) whose input changed.", label, p.changed)
    if p.rehashed:
        log.warning(
            "%s: recomputing %d stored row(s) whose input holds NaN, an infinity or a null "
            "float inside a nested value: they were stored by an earlier version, whose input "
            "hash could not tell these values apart, so whether their input changed is unknown.",
            label,
            p.rehashed,
        )
    if p.resumed or p.kept_failed:
        log.info(
            "%s: resuming; %d of %d rows are done, %d to compute.",
            label,
            p.resumed,
            p.total,
            p.todo.height,
        )
