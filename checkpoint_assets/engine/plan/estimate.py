"""The bill before the run: what one shard's run would compute and cost, computing nothing.

``estimate`` follows a run's start without its writes::

    read_stored    what the checkpoint holds, read without the lock (opening.py); it raises
                   what would stop the run (another job's checkpoint, a changed shard rule)
    plan_rows      what resume leaves to compute (resume.py); global resume's rows count as done
    reparsed       with a changed ``parse``, rows left whose answer is stored: parsed again, no call
    reuse          rows the result store holds, when the run would ask it (``from_store.py``,
                   read only): with reuse on, resume, and no changed ``parse`` to re-derive
    submitted      rows in provider batches sent and not collected yet: collected, not sent again
    dedupe         one row per distinct input, with ``dedupe``
    tokens         the rows left read again, a slice at a time: their request bodies
                   (``Requests.body``), or their input columns' text; input tokens by
                   ``calls/tokens.py``'s counter; output tokens the request's ``max_tokens``
                   (or the resource's), a ceiling: answers stop there at the latest
    cost           the budget's prices, online and at the batch price

Nothing is written: no lock, no meta, no part. A damaged part is an error here (a run would
set it aside and compute its rows again).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import polars as pl

from checkpoint_assets.engine import rows
from checkpoint_assets.engine.calls import tokens
from checkpoint_assets.engine.calls.budget import Budget
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.meta import Meta
from checkpoint_assets.engine.fields import setting
from checkpoint_assets.engine.plan import from_store
from checkpoint_assets.engine.plan.found import importable
from checkpoint_assets.engine.plan.function_fingerprint import parse_changed
from checkpoint_assets.engine.plan.inputs import Prepared
from checkpoint_assets.engine.plan.opening import plan_rows, read_stored
from checkpoint_assets.engine.plan.resume import dedupe
from checkpoint_assets.engine.plan.start import Job
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.rows import ANSWER, INPUT_HASH
from checkpoint_assets.engine.settings import Settings
from checkpoint_assets.engine.sharding.scheme import Scheme

_READ_ROWS = 4096  # rows turned into request bodies at a time


@dataclass(frozen=True)
class Requests:
    """How a shard's rows become requests, for their tokens.

    ``body``: a row (id and input columns, as a dict) to its request body, for a request/parse
    asset; None: the text of a row is its input columns' values (a function that calls an
    endpoint). ``defaults``: what the endpoint resource adds to every request (its
    ``request_defaults()``: ``model``, ``max_tokens``).
    """

    body: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Estimate:
    """What a run would compute and cost: one shard's, or the sum of several. Each field's
    meaning is declared with it (the docs' metadata reference shows them)."""

    rows_total: int = setting(0, "Input rows.")
    rows_done: int = setting(
        0,
        "Rows the checkpoint holds as finished, or failed and kept (`retry_failed: false`); "
        "with `global_resume`, other checkpoints' too.",
    )
    rows_reparsed: int = setting(
        0,
        "Rows left to do whose answer is stored: a changed `parse` reads it again, with no "
        "request. Finished rows are parsed again too, and count as done.",
    )
    rows_submitted: int = setting(
        0,
        "Rows in provider batches submitted and not collected yet: the run collects them and "
        "sends them no more. Their cost is not counted.",
    )
    rows_reused: int = setting(0, "Rows the result store would give.")
    rows_deduped: int = setting(0, "Rows that would take an identical input's result (`dedupe`).")
    rows_to_compute: int = setting(
        0, "Rows the run would compute: rows left after resume, reuse and dedupe."
    )
    input_tokens: int = setting(
        0, "Estimated input tokens of those rows (`tokenizer`; see the operations guide)."
    )
    output_tokens: int = setting(
        0, "The most output tokens those rows may use: each request's `max_tokens`, a ceiling."
    )
    rows_uncapped: int = setting(
        0, "Rows whose request names no `max_tokens`: their output is not counted."
    )
    cost_online_usd: float | None = setting(
        None, "With a `budget`: what those tokens cost through the endpoint, in USD."
    )
    cost_batch_usd: float | None = setting(
        None, "With a `budget`: the same at the provider's batch price."
    )
    tokenizer: str = setting(
        "", "How input tokens were counted: `tiktoken <encoding>` or `bytes/4`."
    )

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def summary(self) -> str:
        """The estimate in one line, for people."""
        said = (
            f"{self.rows_to_compute:,} of {self.rows_total:,} row(s) to compute "
            f"({self.rows_done:,} done, {self.rows_reparsed:,} reparsed, {self.rows_submitted:,} "
            f"submitted, {self.rows_reused:,} "
            f"reused, {self.rows_deduped:,} deduped); {self.input_tokens:,} input tokens "
            f"({self.tokenizer}), at most {self.output_tokens:,} output tokens"
        )
        if self.rows_uncapped:
            said += f" ({self.rows_uncapped:,} row(s) name no max_tokens: not counted)"
        if self.cost_online_usd is not None and self.cost_batch_usd is not None:
            said += (
                f"; {self.cost_online_usd:,.4f} USD online, {self.cost_batch_usd:,.4f} USD as "
                "provider batches"
            )
        return said

    @classmethod
    def total(cls, shards: Iterable[Estimate]) -> Estimate:
        """The sum of ``shards``."""
        out = cls()
        for shard in shards:
            for f in fields(cls):
                mine, theirs = getattr(out, f.name), getattr(shard, f.name)
                if f.name == "tokenizer":
                    out.tokenizer = mine or theirs
                elif theirs is not None:
                    setattr(out, f.name, (mine or 0) + theirs)
        return out


def estimate(
    inputs: Prepared,
    settings: Settings,
    checkpoint: Checkpoint | None,
    *,
    job: Job,
    scheme: Scheme | None,
    imported: pl.DataFrame | None,
    requests: Requests,
    submitted: pl.DataFrame | None = None,
    results: ResultStore | None = None,
) -> Estimate:
    """What a run of ``inputs`` on ``checkpoint`` (None: checkpointing off) would compute and
    cost (see the module docstring); raises what would stop that run before its first call.

    ``submitted``: the id and ``_input_hash`` of the rows in the checkpoint's open provider
    batch submissions. ``results``: the result store the run would take results from; its
    rows must be prepared with their content key (``prepare(..., content=True)``)."""
    id_column = settings.id_column
    stored, meta, reparse = rows.empty(id_column), None, False
    if checkpoint is not None:
        found = read_stored(
            inputs.keys, settings, checkpoint, job, scheme, importing=imported is not None
        )
        used = found.meta is not None and settings.resume and found.same_job
        meta = found.meta if used else None
        stored = found.loaded.rows if used else stored
        recorded = meta.function_fingerprint if meta is not None else None
        reparse = bool(recorded and job.function) and parse_changed(
            recorded or {}, job.function or {}
        )
    plan = plan_rows(inputs, settings, stored, meta)
    todo = plan.todo
    if checkpoint is not None and imported is not None and settings.resume:
        taken = importable(stored, imported, inputs.keys, id_column)
        todo = todo.join(_matching(todo, taken, id_column), on=id_column, how="anti")
    out = Estimate(rows_total=plan.total, rows_done=plan.total - todo.height)
    if reparse and ANSWER in stored.columns:
        answered = _matching(todo, stored.filter(pl.col(ANSWER).is_not_null()), id_column)
        out.rows_reparsed = answered.height
        todo = todo.join(answered, on=id_column, how="anti")
    if results is not None and checkpoint is not None and settings.resume:
        rederives = reparse and stored.height > 0  # such a run takes nothing from the store
        reused = todo.clear() if rederives else _reused(todo, results, job, settings, meta)
        out.rows_reused = reused.height
        todo = todo.join(reused.select(id_column), on=id_column, how="anti")
    if submitted is not None and submitted.height:
        sent = _matching(todo, submitted, id_column)
        out.rows_submitted = sent.height
        todo = todo.join(sent, on=id_column, how="anti")
    if settings.dedupe and todo.height:
        todo, copies = dedupe(todo, id_column)
        out.rows_deduped = copies.rows.height
    out.rows_to_compute = todo.height
    _count_tokens(out, inputs, todo, requests, settings.budget)
    return out


def _matching(todo: pl.DataFrame, rows: pl.DataFrame, id_column: str) -> pl.DataFrame:
    """The ids of ``todo`` that ``rows`` holds with the same input hash."""
    if rows.height == 0 or id_column not in rows.columns:
        return todo.clear().select(id_column)
    wanted = rows.select(pl.col(id_column).cast(todo.schema[id_column]), INPUT_HASH)
    return todo.join(wanted, on=[id_column, INPUT_HASH], how="semi").select(id_column)


def _reused(
    todo: pl.DataFrame, results: ResultStore, job: Job, settings: Settings, meta: Meta | None
) -> pl.DataFrame:
    """The ids of ``todo`` that the run would take from ``results``, as ``found.py`` does:
    the rows it holds in the job's scope, whose outputs fit the checkpoint's (``meta``)."""
    id_column = settings.id_column
    if not job.function:
        return todo.clear().select(id_column)  # the run does not ask the store
    answered = job.parse is not None
    held = from_store.held(todo, results, job.scope, id_column, answered=answered)
    if held is None:
        return todo.clear().select(id_column)
    # Rows parsed again get the current parse's columns, which a dry run does not compute.
    known = None if answered or meta is None else meta.output_schema
    if not from_store.fits(held, known, id_column):
        return todo.clear().select(id_column)
    return held.select(id_column)


def _count_tokens(
    out: Estimate,
    inputs: Prepared,
    todo: pl.DataFrame,
    requests: Requests,
    budget: Budget | None,
) -> None:
    """Add the tokens and cost of the ``todo`` rows to ``out``, their input read again."""
    model = requests.defaults.get("model")
    count = tokens.counter(None if model is None else str(model))
    out.tokenizer = count.name
    frames = [_usage(some, inputs, requests, count) for some in inputs.todo(todo, _READ_ROWS)]
    usage = pl.concat(frames) if frames else pl.DataFrame(schema=_USAGE)
    out.input_tokens = int(usage.get_column("input").sum())
    out.output_tokens = int(usage.get_column("output").sum())
    out.rows_uncapped = usage.get_column("output").null_count()
    if budget is None:
        return
    by_model = usage.group_by("model").agg(pl.col("input").sum(), pl.col("output").sum())
    online = batch = 0.0
    for name, n_in, n_out in by_model.iter_rows():
        priced = name if budget.model_column else None
        online += budget.cost(priced, n_in or 0, n_out or 0)
        batch += budget.cost(priced, n_in or 0, n_out or 0, batch=True)
    out.cost_online_usd, out.cost_batch_usd = online, batch


_USAGE = {"model": pl.String, "input": pl.Int64, "output": pl.Int64}


def _usage(
    rows: pl.DataFrame, inputs: Prepared, requests: Requests, count: tokens.Counter
) -> pl.DataFrame:
    """Each row's model, input tokens and most output tokens (null: its request names none)."""
    defaults = requests.defaults
    if requests.body is None:
        text = _input_text(rows, inputs.columns[1:])
        cap = tokens.max_output(defaults)
        models = [defaults.get("model")] * rows.height
        caps = [cap] * rows.height
    else:
        bodies = [
            {**defaults, **requests.body(row)} for row in rows.select(inputs.columns).to_dicts()
        ]
        text = pl.Series([tokens.text_of(b) for b in bodies], dtype=pl.String)
        models = [b.get("model") for b in bodies]
        caps = [tokens.max_output(b) for b in bodies]
    return pl.DataFrame(
        {
            "model": pl.Series([None if m is None else str(m) for m in models], dtype=pl.String),
            "input": count.tokens(text),
            "output": pl.Series(caps, dtype=pl.Int64),
        }
    )


def _input_text(rows: pl.DataFrame, columns: Iterable[str]) -> pl.Series:
    """The text of each row's input columns, one per line (nested values as JSON)."""
    parts = []
    for name in columns:
        dtype = rows.schema[name]
        if dtype.is_nested():
            parts.append(
                pl.col(name).map_elements(json.dumps, return_dtype=pl.String, skip_nulls=False)
            )
        else:
            parts.append(pl.col(name).cast(pl.String))
    if not parts:
        return pl.Series([""] * rows.height, dtype=pl.String)
    return rows.select(pl.concat_str(parts, separator="\n", ignore_nulls=True)).to_series()
