"""The errors that stop a run early: too many failed rows, an outage, a spent quota, a broken
function, a spend limit, provider batches not ended yet.

Each says what the run had done (``done``): those rows are checkpointed, and a rerun resumes.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from checkpoint_assets.engine.errors.base import CheckpointError

_RERUN = "Materialize the partition again, or let failed_partitions_sensor retry it: it resumes."


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
    """The shard stopped for a spent quota: the provider said so (``stated``, such as OpenAI's
    ``insufficient_quota`` or Anthropic's spend limit), or the endpoint kept rate limiting the
    shard for ``max_throttle_seconds``.

    Everything done is checkpointed, and no row was marked failed.
    """

    def __init__(self, label: str, why: str, done: int, *, stated: bool = False) -> None:
        self.why = why
        self.done = done
        self.stated = stated
        said = "Waiting does not help" if stated else "The quota looks spent"
        super().__init__(
            f"{label}: stopped early, {why}. {said}; {_ran(done)}, and no row was marked failed."
        )

    def engine_remedy(self) -> str:
        if self.stated:
            return (
                "Raise the limit or add credit in the provider's billing settings, then run "
                "again: it resumes, and sends only the rows not done."
            )
        return (
            "Check the endpoint's quota or plan, or raise max_throttle_seconds; running again "
            "resumes."
        )

    def dagster_remedy(self) -> str:
        if self.stated:
            return (
                "Raise the limit or add credit in the provider's billing settings; then "
                f"{_RERUN[0].lower()}{_RERUN[1:]}"
            )
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
        self,
        label: str,
        rows: int,
        batches: Sequence[str],
        done: int,
        due: float | None = None,
        *,
        unsubmitted: int = 0,
    ) -> None:
        self.rows = rows
        self.batches = list(batches)
        self.done = done
        self.due = due  # when the provider ends the last of them at the latest (epoch seconds)
        self.unsubmitted = unsubmitted  # rows the provider's queue had no room for yet
        said = []
        if self.batches:
            said.append(
                f"{rows:,} row(s) are submitted in {len(self.batches)} provider batch(es) "
                f"that have not ended yet ({', '.join(self.batches[:5])}"
                f"{', ...' if len(self.batches) > 5 else ''}); they are recorded in the "
                "checkpoint and will not be submitted again"
            )
        if unsubmitted:
            said.append(
                f"{unsubmitted:,} row(s) wait for room in the provider's queue, to be submitted "
                "by a later run"
            )
        super().__init__(
            f"{label}: {'; '.join(said)}; {_ran(done)}. The shard is not finished yet."
        )

    def engine_remedy(self) -> str:
        if self.unsubmitted and not self.batches:
            return (
                "Run it again once the provider's queue has room (batches of other shards end), "
                "or run with waiting on to wait for room and for the batches."
            )
        return (
            "Run it again once they end (it collects their results without submitting them "
            "again, and submits the rows that waited for room), or run with waiting on to wait "
            "for them."
        )
