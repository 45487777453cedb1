"""Calls to a remote model: rows per call apart from rows per flush, group commit, rate limits,
adaptive concurrency, broken functions and usage sums. The engine runs for real on real
checkpoints (local disk and the moto S3 server where storage matters)."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import threading
import time
from dataclasses import dataclass, field
from email.utils import format_datetime
from typing import Any

import httpx
import openai
import polars as pl
import pytest
from helpers.jobs import Storage, route, tickets

from checkpoint_assets import FunctionError, QuotaExhaustedError, RetryAfter, cli
from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.settings import RunStats
from checkpoint_assets.engine.storage import Store
from checkpoint_assets.engine.throttle import Throttle, Throttled, retry_after_seconds, throttled

ID = "ticket_id"


def _settings(**kw: Any) -> Settings:
    base: dict[str, Any] = {
        "id_column": ID,
        "input_columns": ("body",),
        "retry_delay_seconds": 0.0,
        "min_flush_seconds": 0.0,
        "progress_seconds": 3600.0,
    }
    return Settings(**(base | kw))


def _run(
    fn: Any, n: int, storage: Storage, name: str = "job", **kw: Any
) -> tuple[pl.DataFrame, RunStats]:
    s = _settings(**kw)
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), name)
    return run(fn, prepare(tickets(n), s), checkpoint, s, job={"test": 1})


@pytest.fixture
def local(tmp_path: Any) -> Storage:
    return (str(tmp_path / "checkpoints"), {})


def _stored(storage: Storage, name: str = "job") -> pl.DataFrame:
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), name)
    meta = checkpoint.read_meta()
    assert meta is not None
    return checkpoint.read_result(ID, list(meta.output_schema or {}), meta=meta)


# -- rows per call, rows per flush, group commit --------------------------------------------------
def test_batch_size_sets_rows_per_call_and_the_interval_rows_per_flush(local: Storage) -> None:
    sizes: list[int] = []

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        sizes.append(batch.height)
        return route(batch)

    result, stats = _run(fn, 40, local, batch_size=1, checkpoint_interval=8)

    assert sizes == [1] * 40
    assert stats.calls == 40
    assert 1 <= stats.flushes <= 40 // 8  # parts of 8 rows or more, never a part per row
    assert result.get_column("_error").null_count() == 40


def test_without_batch_size_a_call_takes_one_interval(local: Storage) -> None:
    sizes: list[int] = []

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        sizes.append(batch.height)
        return route(batch)

    _run(fn, 20, local, checkpoint_interval=8)

    assert sizes == [8, 8, 4]


class SlowStore:
    """Wraps a store: each write of a part takes ``delay`` seconds, and its rows are recorded."""

    def __init__(self, store: Store, delay: float) -> None:
        self._store = store
        self.delay = delay
        self.part_rows: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def put(self, path: str, data: bytes) -> None:
        if ".parts/" in path:
            time.sleep(self.delay)
            self.part_rows.append(pl.read_parquet(io.BytesIO(data)).height)
        self._store.put(path, data)


def test_calls_do_not_wait_for_a_slow_store_and_rows_join_the_next_flush(
    storage: Storage,
) -> None:
    base_dir, options = storage
    store = SlowStore(open_store(base_dir, options), delay=0.3)
    s = _settings(checkpoint_interval=4, batch_size=1, max_concurrency=4)
    checkpoint = Checkpoint(store, "job")  # type: ignore[arg-type]

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        time.sleep(0.01)
        return route(batch)

    result, _ = run(fn, prepare(tickets(120), s), checkpoint, s, job={"test": 1})

    assert result.get_column("_error").null_count() == 120
    # 120 rows in 10 ms calls, 4 at a time, take ~0.3 s: one part write. Rows done meanwhile
    # went into a few large flushes instead of 30 parts of 4 waited for one by one.
    assert store.part_rows, "rows were flushed as parts"
    assert len(store.part_rows) < 120 // 4 // 2
    assert max(store.part_rows) <= s.max_unflushed_rows  # memory stays bounded
    assert sum(store.part_rows) < 120  # the tail goes straight into the merged file
    assert sorted(_stored(storage)[ID].to_list()) == list(range(120))


# -- rate limits ----------------------------------------------------------------------------------
@dataclass
class Endpoint:
    """An in-process endpoint that admits ``admit`` calls at once and answers the others with
    ``error(retry_after)``; records when every call started."""

    admit: int
    delay: float
    error: Any
    retry_after: float | None = 0.2
    in_flight: int = 0
    starts: list[float] = field(default_factory=list)
    rejected_at: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    throttle_first: int = 0  # reject this many calls whatever the load (then admit by load)
    reject_after: float = 0.0  # a refusal takes this long to arrive, like one over a network

    def __call__(self, batch: pl.DataFrame) -> pl.DataFrame:
        with self.lock:
            now = time.monotonic()
            self.starts.append(now)
            rejected = self.throttle_first > 0 or self.in_flight >= self.admit
            if rejected:
                self.throttle_first -= 1
                self.rejected_at.append(now)
            else:
                self.in_flight += 1
        if rejected:
            time.sleep(self.reject_after)
            raise self.error(self.retry_after)
        try:
            time.sleep(self.delay)
            return route(batch)
        finally:
            with self.lock:
                self.in_flight -= 1


def _httpx_429(retry_after: float | None) -> httpx.HTTPStatusError:
    headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    response = httpx.Response(429, headers=headers, request=request)
    return httpx.HTTPStatusError("429 Too Many Requests", request=request, response=response)


def _openai_429(retry_after: float | None) -> openai.RateLimitError:
    headers = {} if retry_after is None else {"retry-after-ms": str(int(retry_after * 1000))}
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    response = httpx.Response(429, headers=headers, request=request)
    return openai.RateLimitError("Rate limit reached", response=response, body=None)


def _openai_503(retry_after: float | None) -> openai.APIStatusError:
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    response = httpx.Response(503, headers={}, request=request)
    return openai.APIStatusError("Service Unavailable", response=response, body=None)


@pytest.mark.parametrize(
    "error",
    [RetryAfter, _httpx_429, _openai_429],
    ids=["RetryAfter", "httpx-429-Retry-After", "openai-429-retry-after-ms"],
)
def test_a_throttle_pauses_every_worker_until_retry_after_and_marks_no_row_failed(
    local: Storage, error: Any
) -> None:
    endpoint = Endpoint(admit=100, delay=0.02, error=error, retry_after=0.3, throttle_first=1)

    result, stats = _run(
        endpoint, 60, local, batch_size=1, checkpoint_interval=8, max_concurrency=8, max_attempts=1
    )

    assert result.get_column("_error").null_count() == 60, "a throttle is not a failure"
    assert stats.failed_calls == 0 and stats.throttle_events == 1
    assert stats.throttled_calls == 1 and stats.calls == 60
    assert 0.29 <= stats.throttled_seconds <= 0.5
    (rejected,) = endpoint.rejected_at
    # Calls that got through the gate while the 429 was on its way back may start just after
    # it (microseconds here); once the shard knows, none starts before Retry-After allows.
    later = [t for t in endpoint.starts if t > rejected + 0.01]
    assert later, "the shard went on after the pause"
    assert min(later) >= rejected + 0.3, "a call started before Retry-After allowed it"


def test_a_throttle_without_retry_after_backs_off_exponentially(local: Storage) -> None:
    endpoint = Endpoint(admit=100, delay=0.0, error=_openai_503, throttle_first=3)

    result, _ = _run(endpoint, 4, local, max_attempts=1, retry_delay_seconds=0.05)

    assert result.get_column("_error").null_count() == 4
    gaps = [b - a for a, b in zip(endpoint.starts, endpoint.starts[1:], strict=False)][:3]
    assert [round(g, 1) for g in gaps] >= [0.0, 0.1, 0.2]  # 0.05, 0.1, 0.2 s
    assert gaps[0] >= 0.05 - 0.005 and gaps[1] >= 0.1 - 0.005 and gaps[2] >= 0.2 - 0.005


def test_a_burst_of_throttles_is_one_event_and_concurrency_settles_under_the_limit(
    local: Storage,
) -> None:
    endpoint = Endpoint(admit=16, delay=0.04, error=_httpx_429, retry_after=0.05, reject_after=0.02)

    result, stats = _run(
        endpoint, 600, local, batch_size=1, checkpoint_interval=64, max_concurrency=64
    )

    assert result.get_column("_error").null_count() == 600
    assert stats.failed_calls == 0
    # The first burst (64 calls against 16 admitted, refused 20 ms later) is one event; the
    # exact count of later probes depends on timing (see the Throttle test below for the rule).
    assert stats.throttled_calls >= 3 * stats.throttle_events
    assert stats.throttle_events <= 10
    assert 8 <= stats.concurrency_final <= 16


def test_throttles_from_calls_already_in_flight_are_one_event_and_halve_once() -> None:
    now = [0.0]
    gate = Throttle(64, max_seconds=60, clock=lambda: now[0])
    started = [gate.acquire() for _ in range(64)]
    assert gate.in_flight == 64
    now[0] = 0.01
    for s in started[32:]:
        gate.throttle(s or 0.0, Throttled(0.2, "HTTP 429"))  # refused at once: one burst
    for _ in started[:32]:
        gate.release(True)  # the admitted ones answer later
    assert gate.events == 1 and gate.limit == 32
    assert gate.resume_at == pytest.approx(0.21) and gate.throttled_seconds == pytest.approx(0.2)
    # After the pause, calls that start and are throttled again are a new event.
    assert gate.limit == 32, "growth past the burst's lowest refused level is slow"
    now[0] = 0.3
    for _ in range(32):
        gate.acquire()
    gate.throttle(now[0], Throttled(None, "HTTP 503"))
    assert gate.events == 2 and gate.limit == 16


def test_growth_is_quick_below_the_last_throttled_level_and_slow_past_it() -> None:
    gate = Throttle(64, max_seconds=60, clock=lambda: 0.0)
    for _ in range(33):
        gate.acquire()
    gate.throttle(0.0, Throttled(0.0, "HTTP 429"))  # 33 in flight: one too many
    assert gate.limit == 16
    for _ in range(32):  # the 32 admitted answer: one more per two successes
        gate.release(True)
    assert gate.limit == 16 + 32 // 2 == 32  # just under the level that was refused
    for _ in range(32 * 4):  # past it, one more per several windows: a probe, not a hammer
        gate.acquire()
        gate.release(True)
    assert gate.limit == 32


def test_a_quota_that_stays_spent_stops_the_run_with_what_is_done_checkpointed(
    local: Storage,
) -> None:
    calls = 0

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RetryAfter(0.1)
        return route(batch)

    with pytest.raises(QuotaExhaustedError) as raised:
        _run(fn, 40, local, checkpoint_interval=4, max_throttle_seconds=0.5)

    message = str(raised.value)
    assert "quota looks spent" in message and "max_throttle_seconds" in message
    assert "12 rows done before are checkpointed" in message
    stored = _stored(local)
    assert stored.height == 12 and stored.get_column("_error").null_count() == 12

    _, again = _run(route, 40, local, checkpoint_interval=4)  # the quota is back
    assert again.rows_resumed == 12 and again.rows_computed == 28


def test_retry_after_headers_in_seconds_and_http_dates() -> None:
    assert retry_after_seconds({"retry-after": "2.5"}) == 2.5
    assert retry_after_seconds({"retry-after-ms": "150", "retry-after": "9"}) == 0.15
    now = time.time()
    date = format_datetime(dt.datetime.fromtimestamp(now + 30, tz=dt.UTC), usegmt=True)
    assert 28 <= (retry_after_seconds({"Retry-After": date}, now=now) or 0) <= 31
    assert retry_after_seconds({"retry-after": "soon"}) is None
    assert retry_after_seconds({}) is None


def test_only_rate_limits_count_as_throttles() -> None:
    assert throttled(_httpx_429(1.0)) is not None
    assert throttled(_openai_503(None)) is not None
    request = httpx.Request("GET", "http://127.0.0.1/")
    server_error = httpx.HTTPStatusError(
        "500", request=request, response=httpx.Response(500, request=request)
    )
    assert throttled(server_error) is None
    assert throttled(ValueError("no")) is None
    try:
        try:
            raise _httpx_429(2.0)
        except httpx.HTTPStatusError as e:
            raise RuntimeError("the model call failed") from e
    except RuntimeError as wrapped:
        seen = throttled(wrapped)
    assert seen is not None and seen.seconds == 2.0


# -- broken functions -----------------------------------------------------------------------------
def _broken_on_third_call(how: str, calls: list[int]) -> Any:
    def fn(batch: pl.DataFrame) -> Any:
        calls.append(batch.height)
        out = route(batch)
        if len(calls) < 3:
            return out
        if how == "list":
            return out.to_dicts()
        if how == "no-id":
            return out.drop(ID)
        if how == "unknown-ids":
            return out.with_columns(pl.col(ID) + 1000)
        if how == "attribute":
            return batch.no_such_method()
        raise AssertionError(how)

    return fn


@pytest.mark.parametrize("how", ["list", "no-id", "unknown-ids", "attribute"])
def test_a_broken_result_stops_at_once_after_checkpointing_what_is_done(
    local: Storage, how: str
) -> None:
    calls: list[int] = []
    fn = _broken_on_third_call(how, calls)

    with pytest.raises(FunctionError) as raised:
        _run(fn, 40, local, checkpoint_interval=4, max_attempts=3)

    assert "the function is broken, not the endpoint" in str(raised.value)
    assert "8 rows done before are checkpointed" in str(raised.value)
    assert len(calls) == 3, "a broken function is not retried"
    stored = _stored(local)
    assert stored.height == 8 and stored.get_column("_error").null_count() == 8


def test_a_function_called_with_a_signature_it_does_not_have_fails_on_the_first_call(
    local: Storage,
) -> None:
    calls = 0

    def two_args(batch: pl.DataFrame, model: str) -> pl.DataFrame:
        nonlocal calls
        calls += 1
        return route(batch)

    with pytest.raises(FunctionError) as raised:
        _run(two_args, 40, local, checkpoint_interval=4)

    assert "TypeError" in str(raised.value) and "model" in str(raised.value)
    assert calls == 0


def test_a_type_error_inside_the_function_is_a_poison_row_not_a_broken_function(
    local: Storage,
) -> None:
    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        if 5 in batch.get_column(ID).to_list():
            return None + 1  # type: ignore[operator,no-any-return]  # a bug that one row hits
        return route(batch)

    result, _ = _run(fn, 12, local, checkpoint_interval=4, max_failed_fraction=1.0)

    failed = result.filter(pl.col("_error").is_not_null())
    assert failed.get_column(ID).to_list() == [5]
    assert "TypeError" in failed.get_column("_error")[0]


# -- usage ----------------------------------------------------------------------------------------
def test_usage_columns_are_summed_for_this_run_and_for_every_stored_row(local: Storage) -> None:
    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        return route(batch).with_columns(tokens=pl.col(ID) % 3 + 1, cost=pl.lit(0.5))

    usage = ("tokens", "cost")
    _, first = _run(fn, 30, local, checkpoint_interval=4, usage_columns=usage)
    expected_tokens = float(sum(i % 3 + 1 for i in range(30)))
    assert first.usage == {"tokens": expected_tokens, "cost": 15.0}
    assert first.usage_total == first.usage

    _, second = _run(fn, 40, local, checkpoint_interval=4, usage_columns=usage)
    assert second.usage == {"tokens": float(sum(i % 3 + 1 for i in range(30, 40))), "cost": 5.0}
    assert second.usage_total == {"tokens": float(sum(i % 3 + 1 for i in range(40))), "cost": 20.0}
    meta = Checkpoint(open_store(*local), "job").read_meta()
    assert meta is not None and meta.usage == second.usage_total

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["status", local[0], "--json"]) == 0
    (listed,) = json.loads(out.getvalue())
    assert listed["usage"] == second.usage_total  # what `checkpoint-assets status` shows


def test_a_usage_column_that_is_not_a_numeric_output_is_refused(local: Storage) -> None:
    with pytest.raises(Exception, match=r"usage_columns \['route'\] are not numeric output"):
        _run(route, 8, local, checkpoint_interval=4, usage_columns=("route",))


# -- retried failures are not an outage ---------------------------------------------------------
def test_rerunning_only_stored_failures_that_fail_again_is_not_an_outage(local: Storage) -> None:
    def always_fails(batch: pl.DataFrame) -> pl.DataFrame:
        if (batch.get_column(ID) % 2 == 0).any():  # every even ticket is poison
            raise ValueError("this ticket cannot be routed")
        return route(batch)

    first, _ = _run(always_fails, 32, local, checkpoint_interval=16, max_failed_fraction=1.0)
    assert first.get_column("_error").is_not_null().sum() == 16

    # The rerun retries exactly the 16 failures, in one batch; every call fails again.
    again, stats = _run(always_fails, 32, local, checkpoint_interval=16, max_failed_fraction=1.0)

    assert stats.rows_computed == 16 and stats.failed_calls > 16  # split down to single rows
    assert again.get_column("_error").is_not_null().sum() == 16
