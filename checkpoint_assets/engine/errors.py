"""Errors raised by the checkpoint engine.

Each error carries the facts of what happened (ids, paths, fingerprints) as attributes, and a
``remedy``: what to do. Each class words its own remedy twice. ``engine_remedy`` is in the
engine's terms (settings, the CLI). ``dagster_remedy`` is in Dagster's (run config keys,
``code_version``, the sensor); the Dagster layer asks for it with
:meth:`CheckpointError.in_dagster_terms`. A remedy given where the error is raised (``advise``)
says more than the class's, so it is kept in both. The message a user reads is always ``what
happened`` followed by ``what to do``. The failing operation never touches stored work.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

_RERUN = "Materialize the partition again, or let failed_partitions_sensor retry it: it resumes."


class CheckpointError(Exception):
    """Base class of every error raised by checkpoint-assets: what happened, then what to do.

    Raised as itself for problems of setup. A batch function whose signature cannot be called.
    A source that is not a table. An IO manager that is not a ``CheckpointIOManager``.
    ``global_resume: true`` before ``<asset>_global_resume`` is materialized. An unset variable
    of a ``{"env": "VAR"}`` storage option. A partition loaded before it was checkpointed.
    ``usage_columns`` that are not numeric outputs. A run whose checkpoints would live in a
    temporary Dagster instance. Catch ``CheckpointError`` to handle every error of the package.
    """

    def __init__(self, what: str, remedy: str | None = None) -> None:
        super().__init__(what)
        self.what = what
        self._given = remedy  # said where it was raised; None: the class's own
        self._dagster = False  # the class's own remedy in Dagster's terms

    def __str__(self) -> str:
        return f"{self.what} {self.remedy}".strip()

    @property
    def remedy(self) -> str:
        """What to do: the one given where the error was raised, else the class's own."""
        if self._given is not None:
            return self._given
        return self.dagster_remedy() if self._dagster else self.engine_remedy()

    @remedy.setter
    def remedy(self, remedy: str) -> None:
        self._given = remedy

    def engine_remedy(self) -> str:
        """The class's remedy in the engine's terms (settings, the CLI)."""
        return ""

    def dagster_remedy(self) -> str:
        """The class's remedy in Dagster's terms (run config keys, ``code_version``, the
        sensor); the engine's words where they are the same."""
        return self.engine_remedy()

    def advise(self, remedy: str) -> CheckpointError:
        """Give the remedy of this occurrence, kept in every layer; returns self."""
        self.remedy = remedy
        return self

    def in_dagster_terms(self) -> CheckpointError:
        """Word the class's remedy for a Dagster user (for ``raise e.in_dagster_terms()``)."""
        self._dagster = True
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take facts, not a message: rebuild from the attributes, not from ``args``.
        return (_restore, (type(self), self.__dict__))


def _restore(cls: type[CheckpointError], state: dict[str, Any]) -> CheckpointError:
    error = cls.__new__(cls)
    Exception.__init__(error, state.get("what", ""))
    error.__dict__.update(state)
    return error


class InvalidIdsError(CheckpointError):
    """The id column is missing, has nulls, has duplicates or has an unsupported type.

    Only integers (up to 64 bits) and strings are ids. The message names the column and up to
    five offending values. It is raised before any call.
    """

    def __init__(self, column: str, problem: str, sample: Sequence[Any] = ()) -> None:
        self.column = column
        self.problem = problem
        self.sample = list(sample)[:5]
        what = f"The id column {column!r} {problem}"
        if self.sample:
            what += f", e.g. {self.sample}"
        super().__init__(what + ".")

    def engine_remedy(self) -> str:
        return (
            "Every row needs a unique integer or string id: fix the source, or choose another "
            "id column."
        )


class MissingColumnsError(CheckpointError):
    """Input columns the job reads (``input_columns``) are not in the source."""

    def __init__(self, missing: Sequence[str], available: Sequence[str]) -> None:
        self.missing = list(missing)
        self.available = list(available)
        super().__init__(f"The input has no column(s) {self.missing} (it has {self.available}).")

    def engine_remedy(self) -> str:
        return "Set input_columns to columns of the source, or add the missing ones to the source."

    def dagster_remedy(self) -> str:
        return (
            "Set the checkpointed asset's `input_columns=` to columns of its source asset, or "
            "add the missing columns to the source."
        )


class InputChangedError(CheckpointError):
    """Finished rows whose input columns changed since their result was stored.

    The message counts them and gives sample ids. A result is never joined to another input:
    ``on_input_change: recompute`` computes just those rows again.
    """

    def __init__(self, changed: int, total: int, sample_ids: Sequence[Any]) -> None:
        self.changed = changed
        self.total = total
        self.sample_ids = list(sample_ids)[:5]
        super().__init__(
            "Checkpoint input fingerprint does not match current data. "
            f"{changed} of {total} finished rows changed their input columns since their "
            f"results were stored (ids {self.sample_ids}...). Results are never joined "
            "to different inputs."
        )

    def engine_remedy(self) -> str:
        return (
            "Run with on_input_change='recompute' to recompute just the changed rows, "
            "resume=False to recompute everything, or a new checkpoint tag."
        )

    def dagster_remedy(self) -> str:
        return (
            "Run with `on_input_change: recompute` in run config to recompute just the changed "
            "rows, `resume: false` to recompute everything, or set a new `checkpoint_tag`."
        )


class JobMismatchError(CheckpointError):
    """The checkpoint was written by a different job.

    Another ``code_version``, id column or input columns, or an output schema that differs from
    what the function now returns.
    """

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        super().__init__(what)

    def engine_remedy(self) -> str:
        return (
            "Use a new checkpoint tag (or code version) for this job, or run with resume=False "
            "to replace the stored results."
        )

    def dagster_remedy(self) -> str:
        return (
            "For a new job, change the asset's `code_version` or set a new `checkpoint_tag` in "
            "run config; to replace the stored results, run with `resume: false`."
        )


class JobChangedError(JobMismatchError):
    """The checkpoint was written by another job of this asset: ``changed`` maps each setting
    that differs (``code_version``, ``input_columns``...) to its stored and current values.

    A checkpoint holds one job. The remedy names the steps that start the new one here, and the
    value that resumes the stored results."""

    def __init__(self, path: str, changed: dict[str, tuple[Any, Any]]) -> None:
        self.changed = changed
        differs = "; ".join(
            f"{k}: {old!r} stored, {new!r} now" for k, (old, new) in changed.items()
        )
        super().__init__(
            path,
            f"Checkpoint {path} was written by a different job of this asset ({differs}). Results "
            "of one job are never mixed with another's.",
        )

    def engine_remedy(self) -> str:
        return (
            "To start the new job here, run once with resume=False: it replaces the stored "
            "results, and later runs resume the new ones. To keep both, use a new checkpoint "
            f"tag. To resume the stored results, set {self.restore()}."
        )

    def dagster_remedy(self) -> str:
        restore = " and ".join(
            f"the asset's `{k}` back to {old!r}" if k in _ARGUMENTS else f"`{k}` back to {old!r}"
            for k, (old, _) in self.changed.items()
        )
        return (
            "To start the new job here, materialize once with `resume: false` in run config: it "
            "replaces the stored results, and later runs resume the new ones. To keep both, set "
            f"a new `checkpoint_tag` in run config. To resume the stored results, set {restore}."
        )

    def restore(self) -> str:
        """The settings and values that resume the stored results, in words."""
        return " and ".join(f"{k} back to {old!r}" for k, (old, _) in self.changed.items())


# Job settings that are arguments of the decorators (the others are run config keys).
_ARGUMENTS = ("code_version", "id_column", "input_columns")


class CorruptCheckpointError(CheckpointError):
    """A stored file is unreadable or violates the checkpoint's invariants.

    Duplicate ids in the merged file, missing output columns, a Parquet file that cannot be
    read. Usually two jobs share one tag, or a file was changed by hand.
    ``checkpoint-assets verify`` lists every problem.
    """

    def __init__(self, path: str, problem: str, remedy: str | None = None) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"Checkpoint file {path} {problem}.", remedy)

    # Without a remedy of its own: the likely cause is two jobs sharing the checkpoint.
    def engine_remedy(self) -> str:
        return (
            "Two different jobs probably share this checkpoint: give each its own checkpoint "
            "tag, or start over with resume=False."
        )

    def dagster_remedy(self) -> str:
        return (
            "Two different jobs probably share this checkpoint: give each its own "
            "`checkpoint_tag` in run config, or start over with `resume: false`."
        )


class NewerFormatError(CheckpointError):
    """A checkpoint file was written by a newer version of checkpoint-assets, in a format this
    version cannot read: it is left untouched."""

    def __init__(self, path: str, found: int, readable: int) -> None:
        self.path = path
        self.found = found
        self.readable = readable
        super().__init__(
            f"Checkpoint file {path} was written by a newer version of checkpoint-assets (format "
            f"{found}; this version reads up to {readable}). Nothing was read or changed."
        )

    def engine_remedy(self) -> str:
        return (
            "Upgrade checkpoint-assets (pip install -U checkpoint-assets) in every process that "
            "runs, reads or repairs this checkpoint; or give this version a new checkpoint tag."
        )


class LockHeldError(CheckpointError):
    """Another live writer holds the checkpoint's lock.

    The message names its run id, host, pid and since when. It says when the holder's run is
    over while its process still runs: such a step stops by itself within seconds. It is also
    raised when this run lost its lock: its lease ran out while it was paused, or another writer
    took it over. The run then started no more calls and wrote nothing more. It is raised too
    when a file vanished while this run read it: a second writer changed the checkpoint. A dead
    holder's lock (its process gone on its host, or its lease expired) is taken over with a
    warning.
    """

    def __init__(self, what: str, remedy: str | None = None) -> None:
        super().__init__(what, remedy)
        self.holder: str | None = None  # who holds it, when known


class RunStoppedError(CheckpointError):
    """The step stopped by itself while it held the lock.

    It stops when its run is over in the instance: failed, canceled or succeeded. Run monitoring
    marks a run so when its worker died. It also stops when the process that launched it is gone
    (a run worker, or ``dagster asset materialize``). It stored the rows it computed and released
    the lock: a rerun resumes.
    """

    def __init__(self, label: str, reason: str, done: int) -> None:
        self.label = label
        self.reason = reason
        self.done = done
        super().__init__(
            f"{label}: stopped by itself: {reason}. It stored the {done:,} rows it computed "
            "and released the lock."
        )

    def engine_remedy(self) -> str:
        return "Run it again: it resumes."


class StorageError(CheckpointError):
    """The storage cannot be reached or used.

    A missing filesystem package (``s3fs``, ``gcsfs``, ``adlfs``), a missing bucket, denied
    access, an unreachable endpoint, or a ``base_dir`` that is a file or read-only. Also a listing
    of the parts that stays stale: it misses parts the run wrote or saw, or leaves out flushes
    that later parts follow. Nothing is computed, merged or deleted then.
    """


class TooManyFailuresError(CheckpointError):
    """More rows failed than the asset tolerates; everything else is checkpointed.

    ``no_result`` counts the failed rows the function returned no row for; ``no_result_ids``
    holds a few of them. When they are most of the failures, the function has a bug to fix. The
    message then says so, instead of suggesting to tolerate them.
    """

    def __init__(
        self,
        label: str,
        failed: int,
        total: int,
        allowed: float,
        last_error: str,
        no_result: int = 0,
        no_result_ids: Sequence[Any] = (),
    ) -> None:
        self.failed = failed
        self.total = total
        self.no_result = no_result
        self.no_result_ids = list(no_result_ids)[:5]
        fraction = failed / max(total, 1)
        over = (
            f"{failed:,} of {total:,} rows failed ({fraction:.2%}), more than "
            f"max_failed_fraction={allowed:.2%}. Every other row is checkpointed"
        )
        if not self.missing_results:
            super().__init__(f"{label}: {over} (last error: {last_error or 'stored'}).")
            return
        more = "..." if no_result > len(self.no_result_ids) else ""
        super().__init__(
            f"{label}: the function returned no row for {no_result:,} of the {total:,} ids it "
            f"was given (ids {self.no_result_ids}{more}), so {over}."
        )

    def engine_remedy(self) -> str:
        if self.missing_results:
            return (
                "Make the function return one row per input id (with the id column), or raise "
                "for the rows it cannot do: they are stored as failed and retried. The ids with "
                "no row are computed again on the next run."
            )
        return "The failed rows are computed again on the next run (while retry_failed is on)."

    def dagster_remedy(self) -> str:
        if self.missing_results:
            return (
                "Make the function return one row per input id (with the asset's `id_column`), "
                "or raise for the rows it cannot do: they are stored as failed and retried. "
                "Then materialize the partition again: only the failed rows are computed."
            )
        return (
            "The failed rows are retried on the next run while `retry_failed` is on (materialize "
            "the partition again, or let failed_partitions_sensor do it); raise "
            "`max_failed_fraction` to tolerate them."
        )

    @property
    def missing_results(self) -> bool:
        """Most failed rows are ids the function returned no row for: a bug in the function."""
        return self.no_result * 2 > self.failed

    @classmethod
    def of_several(cls, errors: Sequence[TooManyFailuresError]) -> TooManyFailuresError:
        """One error for several shards of a ranged run (the first, when there is one)."""
        combined = copy.copy(errors[0])
        combined.what = " ".join(e.what for e in errors)
        combined.failed = sum(e.failed for e in errors)
        combined.total = sum(e.total for e in errors)
        combined.no_result = sum(e.no_result for e in errors)
        combined.no_result_ids = [i for e in errors for i in e.no_result_ids][:5]
        return combined


def _ran(done: int) -> str:
    """What a run that stopped early did: its own rows.

    The Dagster layer reports them beside what the checkpoint holds in all, earlier runs' rows
    too."""
    return f"this run had finished {done:,} rows of its own (checkpointed)"


class OutageError(CheckpointError):
    """Every row of several consecutive batches failed: the endpoint looks down.

    The run stopped early. The rows done before are checkpointed, and the failures of the streak
    are not stored as row failures. A rerun when the endpoint is back resumes.
    """

    def __init__(self, label: str, calls: int, last_error: str, done: int) -> None:
        self.calls = calls
        self.last_error = last_error
        self.done = done
        super().__init__(
            f"{label}: stopped early after {calls} calls in a row failed (last error: "
            f"{last_error}). The endpoint looks down or the quota is spent; {_ran(done)}, and "
            "the rest were not marked failed."
        )

    def engine_remedy(self) -> str:
        return "Run again when it is back: the run resumes."

    def dagster_remedy(self) -> str:
        return f"When the endpoint is back: {_RERUN}"


class QuotaExhaustedError(CheckpointError):
    """The endpoint kept rate limiting the shard for ``max_throttle_seconds``: the quota looks
    spent.

    The shard had no successful call in that time. Everything done is checkpointed, and no row
    was marked failed.
    """

    def __init__(self, label: str, why: str, done: int) -> None:
        self.why = why
        self.done = done
        super().__init__(
            f"{label}: stopped early, {why}. The quota looks spent; {_ran(done)}, and no row was "
            "marked failed."
        )

    def engine_remedy(self) -> str:
        return (
            "Check the endpoint's quota or plan, or raise max_throttle_seconds; running again "
            "resumes."
        )

    def dagster_remedy(self) -> str:
        return (
            "Check the endpoint's quota or plan, or raise the asset's `max_throttle_seconds`; "
            f"then {_RERUN[0].lower()}{_RERUN[1:]}"
        )


class FunctionError(CheckpointError):
    """The function itself is broken: retrying cannot help, so the run stops at the first
    occurrence, after checkpointing what is done.

    It was called with arguments it does not take (``TypeError``), or raised an
    ``AttributeError`` on a real object, a ``NameError`` or an ``ImportError``. Or its result is
    not a table, lacks the id column, repeats ids, has null ids, holds ids that were not in the
    batch, or uses a reserved column name. The message says which.
    """

    def __init__(self, label: str, problem: str, done: int) -> None:
        self.problem = problem
        self.done = done
        super().__init__(
            f"{label}: the function is broken, not the endpoint: {problem}. It stopped at "
            f"once; {_ran(done)}."
        )

    def engine_remedy(self) -> str:
        return "Fix the function and run again: the run resumes."

    def dagster_remedy(self) -> str:
        return f"Fix the function, then: {_RERUN}"


class BudgetExceededError(CheckpointError):
    """A spend limit (``max_run_cost`` or ``max_asset_cost``) was reached.

    No new call started; through a provider's batch API, no new submission was sent. What was
    done is checkpointed. For provider batches:

    - ``estimate`` is the estimated cost of the submission that did not fit.
    - ``reserved`` is the estimates of the submissions sent and not collected yet.
    - ``pending`` counts their rows, which the next run collects.
    """

    def __init__(
        self,
        label: str,
        limit_name: str,
        limit: float,
        spent: float,
        done: int,
        *,
        estimate: float | None = None,
        reserved: float = 0.0,
        pending: int = 0,
    ) -> None:
        self.limit_name = limit_name
        self.limit = limit
        self.spent = spent
        self.done = done
        self.estimate = estimate
        self.reserved = reserved
        self.pending = pending
        spender = "this run" if limit_name == "max_run_cost" else "the asset (every shard and run)"
        stop = (
            "No new call was started (calls already in flight were paid and kept)"
            if estimate is None
            else _submissions_stop(estimate, reserved, pending)
        )
        super().__init__(
            f"{label}: stopped at the spend limit: {limit_name} is {limit:.4f} USD and "
            f"{spender} has spent {spent:.4f} USD. {stop}; {_ran(done)}."
        )

    def engine_remedy(self) -> str:
        return (
            f"Raise {self.limit_name} (or remove it) to go on: running again resumes where this "
            "stopped."
        )

    def dagster_remedy(self) -> str:
        return (
            f"To go on, raise the limit for a run in run config, `budget: {{{self.limit_name}: "
            "<USD>}` (or in the asset's `budget=`), and materialize the partition again: it "
            "resumes where this stopped. failed_partitions_sensor does not retry it."
        )


def _submissions_stop(estimate: float, reserved: float, pending: int) -> str:
    """What a budget that stopped provider batch submissions did."""
    kept = (
        f"{reserved:.4f} USD are reserved for the {pending:,} row(s) submitted and not collected "
        "yet (recorded in the checkpoint: the next run collects them without submitting them "
        "again)"
        if pending
        else "what was submitted was collected and stored"
    )
    return (
        f"The next provider batch submission, estimated at {estimate:.4f} USD at the batch "
        f"price, would pass it: nothing more was submitted, and {kept}"
    )


class BatchesPendingError(CheckpointError):
    """A run that submits and ends (``wait`` off) left rows in provider batches not ended yet.

    They are recorded in the checkpoint, and the shard is not finished."""

    def __init__(
        self, label: str, rows: int, batches: Sequence[str], done: int, due: float | None = None
    ) -> None:
        self.rows = rows
        self.batches = list(batches)
        self.done = done
        self.due = due  # when the provider ends the last of them at the latest (epoch seconds)
        super().__init__(
            f"{label}: {rows:,} row(s) are submitted in {len(self.batches)} provider batch(es) "
            f"that have not ended yet ({', '.join(self.batches[:5])}"
            f"{', ...' if len(self.batches) > 5 else ''}); they are recorded in the checkpoint "
            f"and will not be submitted again; {_ran(done)}. The shard is not finished yet."
        )

    def engine_remedy(self) -> str:
        return (
            "Run it again once they end (it collects their results without submitting them "
            "again), or run with waiting on to wait for them."
        )
