"""Fuzzed inputs and function results: nothing is ever silently treated as done.

Whatever the input (ids and input columns of any type, nulls, duplicates, empty inputs) and
whatever the function does (raise, return None, drop ids, add unknown ids, repeat ids, return ids
of another type, return zero rows, add columns), a run ends in one of two ways:

- a ``CheckpointError`` subclass raised before any call, with nothing stored; or
- every input id stored exactly once: a success with the function's exact value (value and type)
  or a failure with ``_error``; the next run resumes with no call; a run of the well-behaved
  function then calls exactly the failed ids; ``checkpoint-assets verify`` finds no problem.

A function that fails on every call stops the run with ``OutageError``, one whose output columns
change stops it with ``JobMismatchError``, and one whose result is not a table for its batch (None,
unknown, duplicate or null ids) stops it at once with ``FunctionError``; each is checked to leave
a valid checkpoint that a later run finishes.

The engine is driven directly (``prepare`` then ``run``) for speed. Examples per property are
modest and derandomized so CI is fast and stable; ``HYPOTHESIS_PROFILE=long`` runs many more
(``HYPOTHESIS_PROFILE=long pytest tests/engine/loop/test_fuzz.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import decimal
import io
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal
from polars.testing.parametric import dtypes, series

from checkpoint_assets import cli
from checkpoint_assets.engine.checkpoints import parquet
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import (
    CheckpointError,
    FunctionError,
    InputChangedError,
    InvalidIdsError,
    JobMismatchError,
    OutageError,
)
from checkpoint_assets.engine.loop import runner
from checkpoint_assets.engine.rows import CURRENT, ERROR, INPUT_HASH, SEQ
from checkpoint_assets.engine.storage import open_store

settings.register_profile(
    "fuzz-ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "fuzz-ci"))

ID = "id"
NAME = "fuzzed/default/all"
INT64 = (-(2**63), 2**63 - 1)
# The parametric testing extension type is polars' own test fixture, not a user's type.
EXOTIC = [d for d in (getattr(pl, "Extension", None),) if d is not None]


# -- strategies --------------------------------------------------------------------------------
@st.composite
def id_columns(draw: st.DrawFn, size: int) -> pl.Series:
    """An id column of any type: ints of every width, big unsigned, unicode strings (empty
    ones too), floats, booleans, nested, temporal, categorical, Python objects; with or without
    nulls and duplicates."""
    kind = draw(st.sampled_from(["int", "string", "mixed", "any"]))
    unique = draw(st.booleans())
    allow_null = draw(st.booleans())
    if kind == "mixed":  # Python objects of several types: never a valid id
        values = draw(
            st.lists(
                st.one_of(st.integers(), st.text(max_size=4), st.none(), st.floats()),
                min_size=size,
                max_size=size,
            )
        )
        return pl.Series(ID, values, dtype=pl.Object)
    if kind == "int":
        dtype = draw(
            st.sampled_from(
                [
                    *(pl.Int8, pl.Int16, pl.Int32, pl.Int64, pl.Int128),
                    *(pl.UInt8, pl.UInt16, pl.UInt32, pl.UInt64, pl.UInt128),
                ]
            )
        )
    elif kind == "string":
        dtype = pl.String
    else:  # never a valid id type; some have too few values to be unique
        dtype = draw(dtypes(excluded_dtypes=EXOTIC, nesting_level=1))
        unique = False
    return draw(
        series(
            name=ID,
            dtype=dtype,
            min_size=size,
            max_size=size,
            unique=unique,
            allow_null=allow_null,
            allow_chunks=True,
        )
    )


@st.composite
def inputs(draw: st.DrawFn, valid_ids: bool = False) -> pl.DataFrame:
    """An input table: an id column and 0-3 input columns of any type (categorical, enum,
    decimal, time zones, nested, binary, NaN and infinities, nulls); 0-24 rows."""
    size = draw(st.integers(0, 24))
    if valid_ids:
        if draw(st.booleans()):
            ids = pl.Series(
                ID,
                draw(st.lists(st.integers(*INT64), min_size=size, max_size=size, unique=True)),
                dtype=pl.Int64,
            )
        else:
            ids = pl.Series(
                ID,
                draw(st.lists(st.text(), min_size=size, max_size=size, unique=True)),
                dtype=pl.String,
            )
    else:
        ids = draw(id_columns(size))
    columns = [ids]
    for i in range(draw(st.integers(0, 3))):
        dtype = draw(dtypes(excluded_dtypes=EXOTIC, nesting_level=2))
        columns.append(draw(series(name=f"in{i}", dtype=dtype, min_size=size, max_size=size)))
    return pl.DataFrame(columns)


BEHAVIOURS = [
    "raise",
    "none",
    "omit",
    "unknown",
    "duplicate",
    "null_id",
    "zero_rows",
    "ids_as_text",
    "extra_column",
    "reordered",
]


@dataclass
class Function:
    """The user's function: echoes its inputs as outputs (so the exact value of every output
    type is known), and misbehaves on every batch that holds one of ``poison``'s ids."""

    input_columns: tuple[str, ...]
    poison: dict[Any, str] = field(default_factory=dict)
    with_id_output: bool = True  # off with dedupe, where copies share their representative's
    calls: list[list[Any]] = field(default_factory=list)

    def outputs(self, batch: pl.DataFrame) -> pl.DataFrame:
        # Output columns in alphabetical order: a checkpoint reorders them so (see the
        # column-order tests below), which is a bug of its own, kept apart from these properties.
        columns = [pl.col(c).alias(f"out_{c}") for c in self.input_columns]
        if self.with_id_output:
            columns.insert(0, pl.col(ID).cast(pl.String).alias("out_id"))
        if not columns:
            columns = [pl.lit("done").alias("out")]
        return batch.select(ID, *columns)

    def __call__(self, batch: pl.DataFrame) -> Any:
        ids = batch.get_column(ID).to_list()
        self.calls.append(ids)
        out = self.outputs(batch)
        bad = [self.poison[i] for i in ids if i in self.poison]
        if not bad:
            return out
        how = bad[0]
        if how == "raise":
            raise RuntimeError(f"model refused batch {ids[:3]}")
        if how == "none":
            return None
        if how == "omit":
            return out.filter(~pl.col(ID).is_in(list(self.poison)))
        if how == "unknown":
            extra = out.head(1).with_columns(pl.lit(_unknown_id(batch)).alias(ID))
            return pl.concat([out, extra])
        if how == "duplicate":
            return pl.concat([out, out.head(1)])
        if how == "null_id":
            return out.with_columns(pl.lit(None, batch.schema[ID]).alias(ID))
        if how == "zero_rows":
            return out.head(0)
        if how == "ids_as_text":
            return out.with_columns(pl.col(ID).cast(pl.String))
        if how == "extra_column":
            return out.with_columns(pl.lit(1).alias("surprise"))
        if how == "reordered":
            return out.reverse().select(reversed(out.columns))
        raise AssertionError(how)


def _unknown_id(batch: pl.DataFrame) -> Any:
    ids = batch.get_column(ID)
    if ids.dtype == pl.String:
        return "\x00unknown" + "".join(ids.to_list())
    return int(ids.max() or 0) + 1 if (ids.max() or 0) < INT64[1] else int(ids.min() or 0) - 1


@dataclass
class Tried:
    """The outcome of one run: its result, or the error it raised, and the calls it made."""

    result: pl.DataFrame | None
    error: BaseException | None
    calls: int


class Sandbox:
    """A checkpoint root in a fresh temporary folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = str(root / "checkpoints")

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(open_store(self.base), NAME)

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    def attempt(
        self, df: pl.DataFrame, fn: Function, settings: runner.Settings, **overrides: Any
    ) -> Tried:
        before = len(fn.calls)
        s = _replace(settings, **overrides)
        try:
            prepared = runner.prepare(df, s)
            result, _ = runner.run(fn, prepared, self.checkpoint(), s, job={"fuzz": 1})
        except Exception as e:
            return Tried(None, e, len(fn.calls) - before)
        return Tried(result, None, len(fn.calls) - before)

    def verify(self) -> None:
        if not self.files():
            return
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli.main(["verify", self.base])
        assert status == 0, f"verify found problems:\n{out.getvalue()}{err.getvalue()}"

    def stored(self) -> pl.DataFrame:
        checkpoint = self.checkpoint()
        meta = checkpoint.meta_file.read()
        if meta is None:
            return pl.DataFrame()
        return checkpoint.read_result(ID, list(meta.output_schema or {}), meta=meta)


@contextlib.contextmanager
def sandbox() -> Iterator[Sandbox]:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        yield Sandbox(Path(folder))


def _replace(s: runner.Settings, **changes: Any) -> runner.Settings:
    return dataclasses.replace(s, **changes)


def _settings(df: pl.DataFrame, **kw: Any) -> runner.Settings:
    base: dict[str, Any] = {
        "id_column": ID,
        "input_columns": tuple(c for c in df.columns if c != ID),
        "checkpoint_interval": 4,
        "retry_delay_seconds": 0.0,
        "max_attempts": 2,
        "max_failed_fraction": 1.0,  # failures are stored, not raised: the property checks them
        "progress_seconds": 3600.0,
    }
    base.update(kw)
    return runner.Settings(**base)


# -- the oracle --------------------------------------------------------------------------------
def ids_valid(ids: pl.Series) -> bool:
    """Whether the engine must accept this id column (integers within Int64, or strings;
    no nulls; unique)."""
    if not (ids.dtype.is_integer() or ids.dtype == pl.String):
        return False
    if ids.null_count() or ids.n_unique() != ids.len():
        return False
    if ids.dtype.is_integer() and ids.len():
        return INT64[0] <= int(ids.min()) and int(ids.max()) <= INT64[1]  # type: ignore[arg-type]
    return True


def expected_ids(df: pl.DataFrame) -> pl.Series:
    ids = df.get_column(ID)
    return ids.cast(pl.Int64) if ids.dtype.is_integer() else ids


def check_complete(df: pl.DataFrame, fn: Function, result: pl.DataFrame) -> set[Any]:
    """Every input id exactly once; successes hold the function's exact value, failures an
    ``_error``. Returns the failed ids."""
    ids = expected_ids(df)
    assert result.height == df.height, "one result row per input id"
    got = result.get_column(ID)
    assert got.dtype == ids.dtype
    assert got.n_unique() == got.len(), "an id is stored more than once"
    assert sorted(got.to_list()) == sorted(ids.to_list()), "ids lost or invented"
    ok = result.filter(pl.col(ERROR).is_null())
    failed = result.filter(pl.col(ERROR).is_not_null())
    assert (failed.get_column(ERROR).str.len_chars() > 0).all(), "a failure needs its reason"
    good = fn.outputs(df.with_columns(ids))
    if ok.height:
        mine = ok.select(good.columns).sort(ID)
        theirs = good.join(ok.select(ID), on=ID, how="semi").sort(ID)
        assert_frame_equal(mine, theirs, check_exact=True)
    return set(failed.get_column(ID).to_list())


def check_untouched(box: Sandbox, tried: Tried) -> None:
    """Refused before any call, with a CheckpointError and nothing stored."""
    assert tried.error is not None
    assert isinstance(tried.error, CheckpointError), repr(tried.error)
    assert tried.calls == 0, "refused only after calling the function"
    assert box.files() == []


# -- properties --------------------------------------------------------------------------------
@FUZZ
@given(df=inputs())
def test_any_input_is_refused_before_any_call_or_stored_exactly(df: pl.DataFrame) -> None:
    fn = Function(tuple(c for c in df.columns if c != ID))
    with sandbox() as box:
        first = box.attempt(df, fn, _settings(df))
        if not ids_valid(df.get_column(ID)):
            check_untouched(box, first)
            assert isinstance(first.error, InvalidIdsError)
            assert repr(ID) in str(first.error), "the message names the id column"
            return
        if first.error is not None:
            # A column a Parquet checkpoint cannot store is refused on the first result, before
            # anything is flushed; the message names it.
            assert isinstance(first.error, CheckpointError), repr(first.error)
            assert "cannot store" in str(first.error)
            assert first.calls <= 1
            box.verify()
            return
        assert first.result is not None
        assert check_complete(df, fn, first.result) == set()
        assert first.calls == (df.height + 3) // 4
        again = box.attempt(df, fn, _settings(df))
        assert again.error is None, repr(again.error)
        assert again.calls == 0, "a finished checkpoint must resume with no call"
        assert again.result is not None
        assert_frame_equal(again.result.sort(ID), first.result.sort(ID), check_exact=True)
        box.verify()


@st.composite
def misbehaving(draw: st.DrawFn) -> tuple[pl.DataFrame, Function, runner.Settings]:
    df = draw(inputs(valid_ids=True))
    dedupe = draw(st.booleans())
    fn = Function(tuple(c for c in df.columns if c != ID), with_id_output=not dedupe)
    ids = df.get_column(ID).to_list()
    if ids:
        poisoned = draw(st.lists(st.sampled_from(ids), unique=True, max_size=min(len(ids), 6)))
        fn.poison = {i: draw(st.sampled_from(BEHAVIOURS)) for i in poisoned}
    s = _settings(
        df,
        checkpoint_interval=draw(st.integers(1, 6)),
        max_concurrency=draw(st.sampled_from([1, 1, 2])),
        max_attempts=draw(st.integers(1, 2)),
        dedupe=dedupe,
    )
    return df, fn, s


@FUZZ
@given(case=misbehaving())
def test_any_function_behaviour_leaves_every_id_stored_once_or_resumable(
    case: tuple[pl.DataFrame, Function, runner.Settings],
) -> None:
    df, fn, s = case
    good = Function(fn.input_columns, with_id_output=fn.with_id_output)
    unstorable = _unstorable(good.outputs(df))
    with sandbox() as box:
        first = box.attempt(df, fn, s)
        if first.error is not None:
            # Only a run-level stop is allowed after calls: the function failed on every call
            # (an outage), changed its output columns (another job) or returned something that
            # is not a result for its batch (a broken function). Nothing is half-stored.
            box.verify()
            if unstorable and type(first.error) is CheckpointError:
                # Refused at the first success, before it is flushed.
                assert "cannot store" in str(first.error)
                assert box.stored().filter(pl.col(ERROR).is_null()).height == 0
                return
            assert isinstance(first.error, OutageError | JobMismatchError | FunctionError), repr(
                first.error
            )
            stored = box.stored()
            if stored.height:
                partial = stored.filter(pl.col(ERROR).is_null())
                check_exact_rows(df, good, partial)
            if not unstorable:  # (otherwise the good function's first result is refused too)
                finish_with(box, df, good, s)
            return
        assert first.result is not None
        failed = check_complete(df, fn, first.result)
        box.verify()
        # A second run of the same function keeps what is stored when failures are not retried.
        again = box.attempt(df, fn, s, retry_failed=False)
        assert again.error is None and again.calls == 0, repr(again.error)
        assert again.result is not None
        # A 'reordered' result stores its columns in another order than the later reads
        # give them (see test_output_columns_out_of_alphabetical_order_resume): values only.
        assert_frame_equal(
            again.result.sort(ID), first.result.sort(ID), check_exact=True, check_column_order=False
        )
        # The fixed function is called with exactly the failed rows, and then all is done.
        fixed = box.attempt(df, good, s)
        if unstorable and fixed.error is not None:  # no success so far; the first is refused
            assert type(fixed.error) is CheckpointError and "cannot store" in str(fixed.error)
            return
        if isinstance(fixed.error, JobMismatchError):
            # The function's surprise columns were the first result stored: the checkpoint
            # holds that schema, and the well-behaved function is rightly another job.
            surprise = set(first.result.columns) - {ERROR}
            assert surprise != set(good.outputs(df.head(0)).columns), repr(fixed.error)
            assert fixed.calls <= len(failed)
            finish_with(box, df, good, s)
            return
        assert fixed.error is None, repr(fixed.error)
        assert fixed.result is not None
        called = {i for call in good.calls for i in call}
        assert called <= failed, "a stored success was computed again"
        if not s.dedupe:
            assert called == failed, "a failed row was treated as done"
        assert check_complete(df, good, fixed.result) == set()
        box.verify()


def _unstorable(outputs: pl.DataFrame) -> bool:
    """Whether a Parquet checkpoint cannot store these outputs (Int128 and the like)."""
    try:
        parquet.check_storable(outputs.head(1))
    except CheckpointError:
        return True
    return False


def check_exact_rows(df: pl.DataFrame, good: Function, ok: pl.DataFrame) -> None:
    if ok.height == 0:
        return
    ids = expected_ids(df)
    expected = good.outputs(df.with_columns(ids)).join(ok.select(ID), on=ID, how="semi")
    assert ok.get_column(ID).is_in(ids.implode()).all(), "an invented id was stored"
    if set(expected.columns) <= set(ok.columns):
        assert_frame_equal(
            ok.select(expected.columns).sort(ID), expected.sort(ID), check_exact=True
        )


def finish_with(box: Sandbox, df: pl.DataFrame, good: Function, s: runner.Settings) -> None:
    """After a run stopped early, the well-behaved function finishes the job."""
    done = box.attempt(df, good, s)
    if isinstance(done.error, JobMismatchError):
        # The stop stored another schema (the function's surprise columns came first): the
        # error says to start over, which must work.
        assert "resume=False" in str(done.error)  # the remedy, in the engine's words
        done = box.attempt(df, good, s, resume=False)
    assert done.error is None, repr(done.error)
    assert done.result is not None
    assert check_complete(df, good, done.result) == set()
    box.verify()
    resumed = box.attempt(df, good, s)
    assert resumed.error is None and resumed.calls == 0


# -- an output type that changes between batches: refused, never coerced -----------------------
@pytest.mark.parametrize(
    "first, later",
    [
        (pl.lit(1), pl.lit("one")),  # Int64, then String
        (pl.lit(1), pl.lit(1.5)),  # Int64, then Float64
        (pl.struct(a=pl.lit(1)), pl.struct(a=pl.lit("x"))),  # a nested type changes
    ],
    ids=["int-then-string", "int-then-float", "struct-field-type"],
)
def test_an_output_type_changing_between_batches_is_never_coerced(
    tmp_path: Path, first: pl.Expr, later: pl.Expr
) -> None:
    df = pl.DataFrame({ID: [1, 2, 3, 4]})

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        value = first if batch.get_column(ID)[0] <= 2 else later
        return batch.select(ID, y=value)

    s = _settings(df, checkpoint_interval=2, max_attempts=1)
    box = Sandbox(tmp_path)
    with pytest.raises(JobMismatchError, match="y"):
        runner.run(fn, runner.prepare(df, s), box.checkpoint(), s, job={})
    # What was stored before the change keeps the type the function returned for it.
    stored = box.checkpoint().read_result(ID, ["y"])
    early = pl.DataFrame({ID: [1, 2]}).select(ID, y=first)
    assert_frame_equal(stored.filter(pl.col(ID) <= 2).select(ID, "y"), early)


def test_the_function_sees_only_the_id_and_input_columns(tmp_path: Path) -> None:
    df = pl.DataFrame({ID: [1, 2, 3], "text": ["a", "b", "c"]})
    seen: list[list[str]] = []

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        seen.append(batch.columns)
        return batch.with_columns(upper=pl.col("text").str.to_uppercase())

    s = _settings(df, max_attempts=1)
    box = Sandbox(tmp_path)
    result, _ = runner.run(fn, runner.prepare(df, s), box.checkpoint(), s, job={})

    assert seen and all(columns == [ID, "text"] for columns in seen)
    assert result.get_column(ERROR).null_count() == 3


@pytest.mark.parametrize(
    "ids",
    [
        pl.Series(ID, [1, 2**64 - 1], dtype=pl.UInt64),
        pl.Series(ID, [0, 2**63], dtype=pl.UInt64),
        pl.Series(ID, [-(2**100), 1], dtype=pl.Int128),
    ],
    ids=["uint64-max", "uint64-2**63", "int128"],
)
def test_integer_ids_beyond_int64_are_refused_before_any_call(
    tmp_path: Path, ids: pl.Series
) -> None:
    df = pl.DataFrame([ids, pl.Series("text", ["a", "b"])])
    fn = Function(("text",))
    box = Sandbox(tmp_path)

    tried = box.attempt(df, fn, _settings(df))

    check_untouched(box, tried)
    assert isinstance(tried.error, InvalidIdsError)
    message = str(tried.error)
    assert repr(ID) in message and "Int64" in message and "string" in message


@pytest.mark.parametrize("what", ["retry-failed-rows", "result-column-order"])
def test_output_columns_out_of_alphabetical_order_resume(tmp_path: Path, what: str) -> None:
    df = pl.DataFrame({ID: [1, 2, 3, 4], "text": ["a", "b", "c", "d"]})
    poison = {1}

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        if poison & set(batch.get_column(ID).to_list()):
            raise ValueError("the model is overloaded")
        return batch.select(ID, zeta=pl.col("text"), alpha=pl.col("text").str.to_uppercase())

    s = _settings(df, checkpoint_interval=2, max_attempts=1)
    box = Sandbox(tmp_path)
    first, _ = runner.run(fn, runner.prepare(df, s), box.checkpoint(), s, job={})
    assert first.columns == [ID, "zeta", "alpha", ERROR]
    if what == "retry-failed-rows":
        poison.clear()  # the model is back: the next run retries id 1
    again, _ = runner.run(fn, runner.prepare(df, s), box.checkpoint(), s, job={})

    assert again.columns == [ID, "zeta", "alpha", ERROR]
    assert again.get_column(ERROR).null_count() == (4 if what == "retry-failed-rows" else 3)


NAN, INF = float("nan"), float("inf")
FLOATS_IN_LIST = pl.List(pl.Float64)
FLOATS_DEEP = pl.List(pl.Struct({"a": pl.List(pl.Float32), "b": pl.String}))


@pytest.mark.parametrize(
    "dtype, before, after",
    [
        (FLOATS_IN_LIST, [NAN], [None]),
        (FLOATS_IN_LIST, [INF], [None]),
        (FLOATS_IN_LIST, [NAN], [INF]),
        (FLOATS_IN_LIST, [-INF], [INF]),
        (FLOATS_IN_LIST, [None], [-INF]),
        (pl.Array(pl.Float64, 2), [1.0, NAN], [1.0, None]),
        (FLOATS_DEEP, [{"a": [NAN], "b": "x"}], [{"a": [None], "b": "x"}]),
        (FLOATS_DEEP, [{"a": [-INF], "b": "x"}], [{"a": [INF], "b": "x"}]),
    ],
    ids=[
        "nan-to-null",
        "inf-to-null",
        "nan-to-inf",
        "-inf-to-inf",
        "null-to--inf",
        "array",
        "struct-in-list-nan-to-null",
        "struct-in-list--inf-to-inf",
    ],
)
def test_a_nan_inside_a_nested_input_changing_to_null_is_a_changed_input(
    tmp_path: Path, dtype: pl.DataType, before: Any, after: Any
) -> None:
    df = pl.DataFrame({ID: [1, 2], "scores": pl.Series([before, before], dtype=dtype)})
    fn = Function(("scores",))
    box = Sandbox(tmp_path)
    first = box.attempt(df, fn, _settings(df))
    assert first.error is None and box.attempt(df, fn, _settings(df)).calls == 0
    changed_df = df.with_columns(pl.Series("scores", [before, after], dtype=dtype))

    changed = box.attempt(changed_df, fn, _settings(df))
    recomputed = box.attempt(changed_df, fn, _settings(df), on_input_change="recompute")

    assert isinstance(changed.error, InputChangedError), repr(changed.error)
    assert changed.error.changed == 1 and changed.calls == 0
    assert recomputed.error is None and recomputed.result is not None
    assert fn.calls[-1] == [2]  # only the changed row
    assert check_complete(changed_df, fn, recomputed.result) == set()


def test_dedupe_never_shares_a_result_between_nan_infinities_and_null_inside_a_list(
    tmp_path: Path,
) -> None:
    values = [[NAN], [None], [INF], [-INF], [NAN], [None]]
    df = pl.DataFrame({ID: range(1, 7), "scores": pl.Series(values, dtype=FLOATS_IN_LIST)})
    fn = Function(("scores",), with_id_output=False)

    tried = Sandbox(tmp_path).attempt(df, fn, _settings(df, dedupe=True))

    assert tried.error is None and tried.result is not None, repr(tried.error)
    assert sorted(i for call in fn.calls for i in call) == [1, 2, 3, 4]  # 5 and 6 are copies
    assert check_complete(df, fn, tried.result) == set()


# -- checkpoints of input hash format 1 --------------------------------------------------------
def _as_written_by_hash_format_1(box: Sandbox, df: pl.DataFrame, s: runner.Settings) -> None:
    """Make the box's checkpoint one of input hash format 1, as older releases write it: its meta
    records no format, and its rows carry format-1 input hashes (where NaN, infinities and null
    inside nested values were all JSON's null). The rows are stored as one more part, written by
    the engine's own writer; the checkpoint stays valid (``verify`` passes)."""
    checkpoint = box.checkpoint()
    meta = checkpoint.meta_file.read()
    assert meta is not None and meta.input_hash_format == 2
    raw = json.loads(meta.to_json())
    del raw["input_hash_format"]
    checkpoint.store.put(checkpoint.files.meta, json.dumps(raw, indent=2).encode())
    stored = checkpoint.load(ID, meta.base_seq, list(meta.output_schema or {}))
    inputs = runner.prepare(df, s)
    earlier = inputs.keys.select(
        ID, pl.Series("__earlier", inputs.earlier_hashes(inputs.keys), dtype=pl.UInt64)
    )
    rows = (
        stored.rows.drop(CURRENT, strict=False)
        .join(earlier, on=ID)
        .with_columns(pl.col("__earlier").alias(INPUT_HASH), pl.lit(stored.next_seq).alias(SEQ))
        .drop("__earlier")
    )
    checkpoint.write_part(rows, stored.next_seq)
    assert checkpoint.meta_file.read().input_hash_format == 1  # type: ignore[union-attr]


FORMAT_1_BEFORE = [[1.5, 2.0], [NAN], [NAN], [INF], [None], [1.5], [-INF]]
FORMAT_1_AFTER = [[1.5, 2.0], [NAN], [None], [-INF], [None], [1.5], [NAN]]
# ids 2-5 and 7 hold a NaN, an infinity or a null float: format 1 cannot tell whether they changed


def test_a_format_1_checkpoint_recomputes_once_exactly_the_rows_it_cannot_tell_apart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ids = list(range(1, len(FORMAT_1_BEFORE) + 1))
    before = pl.DataFrame({ID: ids, "scores": pl.Series(FORMAT_1_BEFORE, dtype=FLOATS_IN_LIST)})
    after = before.with_columns(pl.Series("scores", FORMAT_1_AFTER, dtype=FLOATS_IN_LIST))
    fn = Function(("scores",))
    box = Sandbox(tmp_path)
    s = _settings(before)
    assert box.attempt(before, fn, s).error is None
    _as_written_by_hash_format_1(box, before, s)
    box.verify()

    with caplog.at_level("WARNING", logger="checkpoint_assets"):
        upgraded = box.attempt(after, fn, s)  # on_input_change="fail": nothing is known changed
    again = box.attempt(after, fn, s)

    assert upgraded.error is None and upgraded.result is not None, repr(upgraded.error)
    assert sorted(i for call in fn.calls[-upgraded.calls :] for i in call) == [2, 3, 4, 5, 7]
    assert check_complete(after, fn, upgraded.result) == set()
    assert "recomputing 5 stored row(s) whose input holds NaN" in caplog.text
    assert "earlier version" in caplog.text
    assert "whose input changed" not in caplog.text
    assert again.error is None and again.calls == 0
    assert box.checkpoint().meta_file.read().input_hash_format == 1  # type: ignore[union-attr]
    box.verify()
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        assert cli.main(["inspect", box.base, NAME]) == 0
    assert "(input hash format 1)" in shown.getvalue()


def test_a_format_1_checkpoint_still_refuses_a_row_whose_input_really_changed(
    tmp_path: Path,
) -> None:
    before = pl.DataFrame(
        {ID: [1, 2], "scores": pl.Series([[1.5], [NAN]], dtype=FLOATS_IN_LIST), "t": ["a", "b"]}
    )
    fn = Function(("scores", "t"))
    box = Sandbox(tmp_path)
    s = _settings(before)
    assert box.attempt(before, fn, s).error is None
    _as_written_by_hash_format_1(box, before, s)
    # id 1: a finite value changed; id 2: NaN kept, but its text changed as well
    after = before.with_columns(pl.Series("scores", [[2.5], [NAN]], dtype=FLOATS_IN_LIST))
    after = after.with_columns(pl.Series("t", ["a", "b!"]))

    refused = box.attempt(after, fn, s)
    recomputed = box.attempt(after, fn, s, on_input_change="recompute")

    assert isinstance(refused.error, InputChangedError), repr(refused.error)
    assert refused.error.changed == 2 and refused.calls == 0
    assert recomputed.error is None and recomputed.result is not None
    assert check_complete(after, fn, recomputed.result) == set()
    assert recomputed.calls == 1


@pytest.mark.parametrize(
    "before, after",
    [
        (pl.lit(dt.time(1, 2, 3, 4)), pl.lit(dt.time(1, 2, 3))),
        (pl.lit(dt.timedelta(seconds=1)), pl.lit(dt.timedelta(seconds=2))),
        (pl.lit([b"\x00"], pl.List(pl.Binary)), pl.lit([b"\x01"], pl.List(pl.Binary))),
        (pl.struct(b=pl.lit(b"x")), pl.struct(b=pl.lit(b"y"))),
        (pl.struct(b=pl.lit(b"x")), pl.lit(None, pl.Struct({"b": pl.Binary}))),
    ],
    ids=["time-fraction", "duration", "list-of-binary", "struct-of-binary", "struct-to-null"],
)
def test_a_changed_input_of_any_type_is_seen_as_changed(
    tmp_path: Path, before: pl.Expr, after: pl.Expr
) -> None:
    df = pl.DataFrame({ID: [1, 2]}).with_columns(before.alias("value"))
    fn = Function(("value",))
    box = Sandbox(tmp_path)
    first = box.attempt(df, fn, _settings(df))
    assert first.error is None and first.result is not None, repr(first.error)
    assert check_complete(df, fn, first.result) == set()

    changed = box.attempt(df.with_columns(after.alias("value")), fn, _settings(df))

    assert isinstance(changed.error, InputChangedError), repr(changed.error)
    assert changed.calls == 0


def test_values_of_every_awkward_type_round_trip_exactly(tmp_path: Path) -> None:
    """A fixed sample of the types the properties draw, so a failure here reads plainly."""
    df = pl.DataFrame(
        {
            ID: ["", "é", "\x00", "a/b", "😀"],
            "cat": pl.Series(["x", "y", None, "x", "z"], dtype=pl.Categorical),
            "enum": pl.Series(["a", "b", "a", None, "b"], dtype=pl.Enum(["a", "b"])),
            "dec": pl.Series(
                [
                    decimal.Decimal("1.25"),
                    None,
                    decimal.Decimal("-3.5"),
                    decimal.Decimal(0),
                    decimal.Decimal("9.99"),
                ],
                dtype=pl.Decimal(10, 3),
            ),
            "tz": pl.Series([dt.datetime(2020, 1, 1, 12)] * 5).dt.replace_time_zone("Asia/Kolkata"),
            "nested": [[{"a": 1}], [], None, [{"a": None}], [{"a": 2}, {"a": 3}]],
            "f": [float("nan"), float("inf"), -0.0, None, 1e308],
        }
    )
    fn = Function(tuple(c for c in df.columns if c != ID))
    box = Sandbox(tmp_path)

    first = box.attempt(df, fn, _settings(df))
    again = box.attempt(df, fn, _settings(df))

    assert first.error is None and first.result is not None, repr(first.error)
    assert check_complete(df, fn, first.result) == set()
    assert again.calls == 0 and again.result is not None
    assert check_complete(df, fn, again.result) == set()
    box.verify()
