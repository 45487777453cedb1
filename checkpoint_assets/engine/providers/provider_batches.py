"""Running a shard through a provider's batch API: submit its rows, wait or end, collect.

The user's per-row logic is two functions: ``request(row) -> dict`` (the request body) and
``parse(body) -> dict`` (output columns, usage columns among them).

:class:`ProviderRun` is a work loop beside :class:`~checkpoint_assets.engine.loop.runner.Run`,
both a ``ShardRun``. The lock, the plan (what is done, ``retry_failed``, dedupe), the sink's
parts, finalize, usage and the stop rules are the same as for computed rows. Its steps:

1. **Re-attach** the open submission records of the checkpoint (``submission_records.py``).
   Those with a batch id are polled; the others are found on the provider by their tag.
2. **Submit** the rows to do that no open submission holds, split within the provider's limits.
   Each submission is recorded (intent) before its upload; its file and batch ids are recorded
   as they come.
3. **Collect**, polling with backoff (``poll_seconds`` doubling up to ``max_poll_seconds``). A
   submission that ended is downloaded, parsed and stored as one part. It is then marked
   collected, or returned when some of its rows are sent again (below).
4. **Send again** the rows left without a result while their attempt is below ``max_attempts``:
   - rows whose request failed in a transient way (the adapter's ``Result.retry``: a server
     error, an overload, a rate limit);
   - rows that an expiry or a cancel left without a result.

   Each submission records its attempt (1 for fresh rows). Its rows sent again go in a new
   submission of the next attempt. That one is recorded after the part of the results it had
   is durable and the old one is marked returned. Other per-request errors (an invalid
   request) are failed rows at once. So are transient ones at the last attempt; the next run
   computes them again while ``retry_failed`` is on.
5. **End**, with ``wait`` off, as soon as every submission is created and what had ended is
   collected. The run ends with :class:`BatchesPendingError`, the shard unfinished.

Answers. Each collected row keeps its response body in ``_answer`` (``keep_answers``). When
``parse`` changed since the stored rows were computed, the run first parses their answers again,
with no request (``answers.py``). Finished rows without one keep their outputs unless
``recompute_unanswered``.

Modes (``ProviderJob.mode``):

- ``batch`` is the above.
- ``hybrid`` submits the same way, but sends no row again as a batch. The rows of an expired,
  cancelled or failed batch, and the requests that failed in a transient way, are finished
  online (``online.py``) while the other batches wait. At ``deadline_seconds`` after the run's
  start it cancels every open submission. Each is collected once it has ended, and its rows
  without a result go online.
- ``online`` submits nothing. It cancels the open submissions of earlier runs (collected
  likewise), and every other row goes online.

No row goes online while a batch that holds it may still answer, so no row is paid twice. A
batch result whose row is stored already (after a crash, a submission collected again) is
dropped and counted (``RunStats.batch_results_dropped``).

Spend budget. Before a submission is recorded or sent, its cost is estimated and reserved in the
run's spend (``Spend.reserve``, at the batch price):

- input tokens: the bytes the provider counts for each request, divided by 4 (``size()``: its
  JSONL line, or its entry in the create's body);
- output tokens: each body's ``max_tokens``, ``max_completion_tokens`` or
  ``max_output_tokens``, the adapter's defaults filled in (0 when it names none, as an
  embedding request);
- priced by the body's ``model`` when the budget has a ``model_column``.

When it does not fit, nothing more is submitted. The submissions made are collected (a waiting
run) or left for the next run, and the run ends with :class:`BudgetExceededError`. When a
submission's results are stored, its reservation is replaced by what its rows cost at the batch
price.

Loss bound. A hard kill loses no paid request. Every submission is recorded before anything is
sent, and its results stay on the provider (OpenAI: 30 days; Anthropic: 29) until a run stores
them. A kill costs the work of the step that was under way:

- one upload again, after a kill between the upload and its record;
- one download again, after a kill before a collected part is durable or before its submission
  is marked collected. Then only the rows not stored yet are stored.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls.batches import Broken, Check, RowResult
from checkpoint_assets.engine.calls.budget import Budget
from checkpoint_assets.engine.errors import (
    BatchesPendingError,
    BudgetExceededError,
    CheckpointError,
    FunctionError,
)
from checkpoint_assets.engine.loop.shard_run import ShardRun
from checkpoint_assets.engine.loop.sink import PartWriter
from checkpoint_assets.engine.providers import online
from checkpoint_assets.engine.providers.answers import ANSWER, dumps, parse_error, rederive
from checkpoint_assets.engine.providers.submission_records import Records, Submission, new_tag
from checkpoint_assets.engine.providers.submissions import (
    WINDOW_SECONDS,
    BatchProvider,
    Request,
    Result,
    State,
    Status,
    custom_id,
    index_of,
)
from checkpoint_assets.engine.rows import ATTEMPTS, BOOKKEEPING, ERROR, INPUT_HASH

_ROWS_PER_CHUNK = 4096  # input rows turned into dicts at a time
_FIND_MARGIN_SECONDS = 600.0  # clocks differ: look for batches created a little before the intent
_BYTES_PER_TOKEN = 4  # a request's input tokens, estimated from its bytes (see the docstring)
_MAX_OUTPUT = ("max_tokens", "max_completion_tokens", "max_output_tokens")  # a body's cap


class Mode(enum.StrEnum):
    """How a request/parse job runs (see the module docstring)."""

    online = "online"
    batch = "batch"
    hybrid = "hybrid"


@dataclass(frozen=True)
class ProviderJob:
    """What a shard sends through a provider's batch API, and how it waits.

    ``request(row)`` gets the id and input columns of one row as a dict and returns its request
    body; ``parse(body)`` gets the provider's response body of that row and returns a dict of
    output columns (the same keys for every row). ``wait`` False ends the run once its rows are
    submitted (see the module docstring). ``keep_answers`` stores each response body in
    ``_answer``; ``recompute_unanswered`` sends the finished rows without one again when
    ``parse`` changed. ``mode``, ``deadline_seconds``: see the module docstring; ``send(body)``
    sends one body online and returns the response body (the endpoint resource's ``sender``),
    needed by ``online`` and ``hybrid``.
    """

    provider: BatchProvider
    request: Callable[[dict[str, Any]], dict[str, Any]]
    parse: Callable[[dict[str, Any]], Mapping[str, Any]]
    wait: bool = True
    poll_seconds: float = 10.0
    max_poll_seconds: float = 300.0
    mode: Mode = Mode.batch
    deadline_seconds: float | None = None
    send: online.Send | None = None
    keep_answers: bool = True
    recompute_unanswered: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.mode is not Mode.batch and self.send is None:
            raise ValueError(f"mode {self.mode.value} sends rows online: it needs send")
        if self.mode is Mode.hybrid and not self.wait:
            raise ValueError(
                "mode hybrid finishes rows online in the run, so it waits for its batches: "
                "drop wait: false, or use mode batch to submit and end."
            )
        if self.deadline_seconds is not None and self.deadline_seconds < 0:
            raise ValueError(f"deadline must be at least 0 seconds, got {self.deadline_seconds}")


@dataclass
class _Split:
    """The rows of one submission, before it is sent: their requests, the bytes of each (as the
    provider counts them), ids and input hashes."""

    tag: str
    requests: list[Request] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)

    def add(self, request: Request, size: int, row_id: Any, input_hash: int) -> None:
        self.requests.append(request)
        self.sizes.append(size)
        self.ids.append(row_id)
        self.hashes.append(input_hash)

    def estimate(self, budget: Budget, defaults: Mapping[str, Any]) -> float:
        """USD the submission may cost at the batch price (see the module docstring)."""
        tokens: dict[str | None, list[float]] = {}  # model -> [input, output]
        for request, size in zip(self.requests, self.sizes, strict=True):
            body = {**defaults, **request.body}
            model = body.get("model") if budget.model_column else None
            counted = tokens.setdefault(None if model is None else str(model), [0.0, 0.0])
            counted[0] += size / _BYTES_PER_TOKEN
            counted[1] += next((body[k] for k in _MAX_OUTPUT if _is_count(body.get(k))), 0)
        return sum(budget.cost(m, i, o, batch=True) for m, (i, o) in tokens.items())


# A failed row: id, input hash, error, attempts, answer (None: none kept).
_Failed = tuple[Any, int, str, int, str | None]


def _is_count(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class ProviderRun(ShardRun):
    """A run whose rows go through a provider's batch API (see the module docstring)."""

    job: ProviderJob

    def work(self, todo: pl.DataFrame) -> CheckpointError | None:
        if not isinstance(self.fn, ProviderJob) or not isinstance(self.sink, PartWriter):
            raise CheckpointError(
                f"{self.label}: provider batches need a checkpoint to record their submissions.",
                "Run with checkpointing on.",
            )
        self.job = self.fn
        self.stats.mode = self.job.mode.value
        self.provider = self.job.provider
        self.records = Records(self.sink.checkpoint.store, self.sink.checkpoint.files)
        self.check = Check(self.id)
        if self.opened.rederive is not None:
            again = self.job.recompute_unanswered
            todo = rederive(self, self.opened.rederive, self.job.parse, self.check, todo, again)
        # Keys (id, input hash, position): rows are read as submissions or online calls take them.
        self.todo = todo
        # The rows to do that no collected result covers yet, with their calls so far.
        self.attempts: dict[Any, int] = dict(
            zip(
                todo.get_column(self.id).to_list(), todo.get_column(ATTEMPTS).to_list(), strict=True
            )
        )
        self.reserved: dict[str, float] = {}  # the estimates of this run's submissions, by tag
        self.refused: BudgetExceededError | None = None  # a submission the budget did not take
        self.online: dict[Any, int] = {}  # rows to finish online, with their calls so far
        self.cancelled: set[str] = set()  # tags of the submissions this run cancelled
        waiting = [s for s in self.records.load() if s.open and self._attach(s)]
        sent = {i for s in waiting for i in s.ids}
        fresh = todo.filter(~pl.col(self.id).is_in(list(sent))) if sent else todo
        if self.job.mode is Mode.online:
            self._go_online(fresh.get_column(self.id).to_list())
        else:
            waiting += self._submit(fresh)
        pending = self._collect_all(waiting)
        if self.spend is not None and self.spend.problem is not None:
            return self.spend.problem  # a result whose cost is unknown
        return self._over_budget_of(pending) if self.refused is not None else pending

    # -- submitting ----------------------------------------------------------------------
    def _attach(self, s: Submission) -> bool:
        """Make sure the open submission ``s`` has its batch; False when it never reached the
        provider (its rows are then submitted again)."""
        if s.batch_id is None:
            found = self.provider.find(s.tag, s.created_at - _FIND_MARGIN_SECONDS)
            if found is None and s.file_id is not None:
                found = self.provider.create([], s.file_id, s.tag)
            if found is None:
                note = "the run that submitted it stopped before anything reached the provider"
                self.records.advance(s, "dropped", note=note)
                return False
            self.records.advance(s, "created", batch_id=found)
        self.log.info(
            "%s: re-attached to provider batch %s (%d rows): nothing is submitted again.",
            self.label,
            s.batch_id,
            len(s.ids),
        )
        return True

    def _submit(self, rows: pl.DataFrame, attempt: int = 1) -> list[Submission]:
        """Submit ``rows`` in as many submissions as the provider's limits take, until the
        spend budget refuses one (then nothing more is submitted)."""
        made = []
        for split in self._split(rows):
            if self.refused is not None or not self._reserve(split):
                break
            made.append(self._send(split, attempt))
        return made

    def _split(self, rows: pl.DataFrame) -> Iterator[_Split]:
        limits = self.provider.limits
        split, size = _Split(new_tag()), 0
        for row, input_hash in self._requests_of(rows):
            request = Request(custom_id(split.tag, len(split.requests)), self._body(row))
            request_size = self.provider.size(request)
            grown = size + request_size
            full = len(split.requests) >= limits.max_requests or grown > limits.max_bytes
            if split.requests and full:
                yield split
                split = _Split(new_tag())
                request = Request(custom_id(split.tag, 0), request.body)
                grown = request_size = self.provider.size(request)
            split.add(request, request_size, row[self.id], input_hash)
            size = grown
        if split.requests:
            yield split

    def _reserve(self, split: _Split) -> bool:
        """Reserve the estimated cost of ``split`` in the spend budget; False when it does not
        fit (``refused`` says why)."""
        if self.spend is None:
            return True
        # The adapters in resources/ complete each body with their resource's defaults (model,
        # max_tokens); the protocol does not require them.
        defaults = getattr(self.provider, "defaults", None) or {}
        estimate = split.estimate(self.spend.budget, defaults)
        try:
            self.spend.reserve(estimate)
        except BudgetExceededError as e:
            self.refused = e
            self.refused.estimate = estimate
            return False
        self.reserved[split.tag] = estimate
        return True

    def _over_budget_of(self, pending: CheckpointError | None) -> BudgetExceededError:
        """The run's end when the budget refused a submission: what was spent and is still
        reserved, against the limit it would have passed."""
        assert self.refused is not None and self.spend is not None
        name, limit = self.refused.limit_name, self.refused.limit
        before = self.spend.asset_spent_before if name == "max_asset_cost" else 0.0
        rows = pending.rows if isinstance(pending, BatchesPendingError) else 0
        return BudgetExceededError(
            self.label,
            name,
            limit,
            before + self.spend.spent,
            self.done_rows,
            estimate=self.refused.estimate,
            reserved=self.spend.reserved,
            pending=rows,
        )

    def _requests_of(self, keys: pl.DataFrame) -> Iterator[tuple[dict[str, Any], int]]:
        """The input rows of ``keys`` (rows of the shard's keys, in order) as dicts, with their
        input hashes, read a slice at a time as the splits take them."""
        for frame in self.prepared.todo(keys, _ROWS_PER_CHUNK):
            visible = frame.select([c for c in frame.columns if c not in BOOKKEEPING])
            for start in range(0, frame.height, _ROWS_PER_CHUNK):
                dicts = visible.slice(start, _ROWS_PER_CHUNK).to_dicts()
                hashes = frame.get_column(INPUT_HASH).slice(start, _ROWS_PER_CHUNK).to_list()
                yield from zip(dicts, hashes, strict=True)

    def _body(self, row: dict[str, Any]) -> dict[str, Any]:
        try:
            body = self.job.request(row)
        except Exception as e:
            problem = f"request() raised {type(e).__name__}: {e} for the row {row[self.id]!r}"
            raise FunctionError(self.label, problem, self.done_rows) from e
        if not isinstance(body, dict):
            problem = f"request() returned {type(body).__name__}; it must return a dict (the body)"
            raise FunctionError(self.label, problem, self.done_rows)
        return body

    def _send(self, split: _Split, attempt: int) -> Submission:
        tag, requests = split.tag, split.requests
        s = Submission(tag, self.provider.name, split.ids, split.hashes, attempt=attempt)
        self.records.record_intent(s)
        file_id = self.provider.upload(requests, tag)
        if file_id is not None:
            self.records.advance(s, "uploaded", file_id=file_id)
        batch_id = self.provider.create(requests, file_id, tag)
        self.records.advance(s, "created", batch_id=batch_id)
        self.stats.calls += len(requests)
        self.log.info(
            "%s: submitted %d rows to %s as batch %s (submission %s).",
            self.label,
            len(requests),
            self.provider.name,
            batch_id,
            tag,
        )
        return s

    # -- collecting ----------------------------------------------------------------------
    def _collect_all(self, waiting: list[Submission]) -> CheckpointError | None:
        delay = self.job.poll_seconds
        while True:
            left: list[Submission] = []
            for s in waiting:
                assert s.batch_id is not None
                status = self.provider.poll(s.batch_id)
                if status.state is State.RUNNING:
                    left.append(s)
                    continue
                again = self._collect(s, status)
                if again:
                    delay = self.job.poll_seconds  # new batches: poll them from the start
                left += again
            waiting = left
            if self.online:
                stopped = self._finish_online()
                if stopped is not None:
                    return stopped  # open submissions stay recorded: the next run re-attaches
            if not waiting:
                return None
            if self._past_deadline() and self._cancel(waiting):
                delay = self.job.poll_seconds  # cancelled batches end soon
            rows = sum(len(s.ids) for s in waiting)
            if not self.job.wait and self.job.mode is Mode.batch:
                batches = [s.batch_id or s.tag for s in waiting]
                due = max(s.created_at for s in waiting) + WINDOW_SECONDS
                return BatchesPendingError(self.label, rows, batches, self.done_rows, due)
            self.log.info(
                "%s: %d row(s) wait in %d provider batch(es); next poll in %.0f s. %s",
                self.label,
                rows,
                len(waiting),
                delay,
                self.progress_line(time.monotonic()),
            )
            time.sleep(delay)
            delay = min(delay * 2, self.job.max_poll_seconds)

    def _collect(self, s: Submission, status: Status) -> list[Submission]:
        """Store the results of the ended submission ``s`` as one part, then mark it; returns
        the submissions of its rows sent again (see the module docstring)."""
        assert s.batch_id is not None
        seen = [False] * len(s.ids)
        failed: list[_Failed] = []
        transient: list[int] = []  # indexes of requests that failed in a transient way
        to_online = self.job.mode is not Mode.batch  # rows without a result go online
        last = not to_online and s.attempt >= self.s.max_attempts
        if status.state is not State.FAILED:
            for result in self.provider.results(s.batch_id):
                index = index_of(result.custom_id, s.tag)
                if index is None or index >= len(s.ids):
                    continue  # not this submission's
                seen[index] = True
                if result.retry and result.error is not None and not last:
                    transient.append(index)
                else:
                    self._take(result, s.ids[index], s.hashes[index], failed)
        unrun = [i for i, got in enumerate(seen) if not got]
        if status.state is State.ENDED or (status.state is State.FAILED and not to_online) or last:
            for i in unrun:
                self._fail(s.ids[i], s.hashes[i], self._no_result(s, status), failed)
            unrun = []
        if self.spend is not None:  # its rows' results count now, at the batch price
            self.spend.release(self.reserved.pop(s.tag, 0.0))
        self.pending_failed.append(self._failures(failed))
        self._commit()
        self.sink.flush()
        assert isinstance(self.sink, PartWriter)
        self.sink.wait_for_writes()  # durable before the record says collected or returned
        back = [s.ids[i] for i in transient + unrun if s.ids[i] in self.attempts]
        if not back:
            self.records.advance(s, "collected")
            return []
        for i in transient:  # each was a call the provider answered
            if s.ids[i] in self.attempts:
                self.attempts[s.ids[i]] += 1
        note = _returned(len(transient), len(unrun), status.state)
        if to_online:
            self.records.advance(s, "returned", note=note + "; finished online")
            self.log.info(
                "%s: provider batch %s: %s; finishing them online.", self.label, s.batch_id, note
            )
            self._go_online(back)
            return []
        self.records.advance(s, "returned", note=note)
        self.log.warning(
            "%s: provider batch %s: %s; sending them again (attempt %d of %d).",
            self.label,
            s.batch_id,
            note,
            s.attempt + 1,
            self.s.max_attempts,
        )
        return self._submit(self.todo.filter(pl.col(self.id).is_in(back)), s.attempt + 1)

    # -- online (hybrid, online) ---------------------------------------------------------
    def _go_online(self, ids: list[Any]) -> None:
        """Take the rows ``ids`` off the batches: they are finished online."""
        for row_id in ids:
            attempts = self.attempts.pop(row_id, None)
            if attempts is not None:
                self.online[row_id] = attempts

    def _finish_online(self) -> CheckpointError | None:
        """Send the rows gone online, each as its own request (``online.finish``)."""
        rows, self.online = self.online, {}
        calls = pl.DataFrame(
            {self.id: list(rows), ATTEMPTS: list(rows.values())},
            schema={self.id: self.todo.schema[self.id], ATTEMPTS: pl.Int32},
        )
        keys = self.todo.drop(ATTEMPTS).join(calls, on=self.id, maintain_order="left")
        job = self.job
        assert job.send is not None
        asking = online.Online(job.request, job.parse, job.send, self.id, job.keep_answers)
        self.log.info("%s: %d row(s) go online.", self.label, keys.height)
        return online.finish(self, asking, keys)

    def _past_deadline(self) -> bool:
        if self.job.mode is Mode.online:
            return True
        deadline = self.job.deadline_seconds
        if self.job.mode is not Mode.hybrid or deadline is None:
            return False
        return time.monotonic() - self.started >= deadline

    def _cancel(self, waiting: list[Submission]) -> bool:
        """Ask the provider to cancel the submissions not cancelled yet; whether any was."""
        fresh = [s for s in waiting if s.tag not in self.cancelled]
        for s in fresh:
            assert s.batch_id is not None
            self.cancelled.add(s.tag)
            try:
                self.provider.cancel(s.batch_id)
            except Exception as e:  # it may have ended meanwhile: it is collected as it is
                self.log.warning("%s: cancelling batch %s: %s", self.label, s.batch_id, e)
        if fresh:
            self.log.info(
                "%s: %s: cancelled %d provider batch(es); their rows without a result go "
                "online once each has ended.",
                self.label,
                "online" if self.job.mode is Mode.online else "the deadline passed",
                len(fresh),
            )
        return bool(fresh)

    def _no_result(self, s: Submission, status: Status) -> str:
        """Why a request of the ended submission ``s`` is a failed row without a result."""
        if status.state is State.FAILED:
            return f"the provider refused the batch {s.batch_id}: {status.detail or 'no detail'}"
        if status.state is State.ENDED:
            return f"the provider's batch {s.batch_id} ended without a result for this request"
        return (
            f"the provider's batch {s.batch_id} {status.state.value} before running this "
            f"request, at attempt {s.attempt} of max_attempts {self.s.max_attempts}"
        )

    def _take(self, result: Result, row_id: Any, input_hash: int, failed: list[_Failed]) -> None:
        """One request's result as a stored row (or a failed one); rows already stored (by a
        run that died before marking the submission collected) are skipped."""
        if result.error is not None or result.body is None:
            self._fail(row_id, input_hash, result.error or "no response body", failed)
            return
        if row_id not in self.attempts:
            self.stats.batch_results_dropped += 1  # stored already: never stored twice
            return
        answer = dumps(result.body) if self.job.keep_answers else None
        try:
            out = self.job.parse(result.body)
        except Exception as e:
            self._fail(row_id, input_hash, parse_error(e), failed, answer)
            return
        try:
            checked = self.check.row(out, row_id)
        except Broken as e:
            raise FunctionError(self.label, f"parse(): {e}", self.done_rows) from None
        if answer is not None:
            checked = {**checked, ANSWER: answer}
        attempts = self.attempts.pop(row_id)
        record = RowResult(checked, row_id, input_hash, attempts + 1)
        self.pending.append(record)
        self.pending_rows += 1
        if self.spend is not None:
            self.spend.add_record(record, batch=True)

    def _fail(
        self,
        row_id: Any,
        input_hash: int,
        why: str,
        failed: list[_Failed],
        answer: str | None = None,
    ) -> None:
        attempts = self.attempts.pop(row_id, None)
        if attempts is not None:  # else stored already
            failed.append((row_id, input_hash, why, attempts + 1, answer))
            self.last_error = why

    def _failures(self, failed: list[_Failed]) -> pl.DataFrame:
        ids, hashes, errors, attempts, answers = zip(*failed, strict=True) if failed else ((),) * 5
        columns = {
            self.id: pl.Series(list(ids), dtype=self.inputs.schema[self.id]),
            INPUT_HASH: pl.Series(list(hashes), dtype=pl.UInt64),
            ERROR: pl.Series(list(errors), dtype=pl.String),
            ATTEMPTS: pl.Series(list(attempts), dtype=pl.Int32),
        }
        if self.job.keep_answers:  # the body a parse() raised for; none for a refused request
            columns[ANSWER] = pl.Series(list(answers), dtype=pl.String)
        return pl.DataFrame(columns)


def _returned(transient: int, unrun: int, state: State) -> str:
    """What a returned submission's record says of its rows sent again."""
    said = [f"{transient} request(s) failed in a transient way"] if transient else []
    said += [f"{unrun} request(s) got no result: the batch {state.value}"] if unrun else []
    return "; ".join(said)
