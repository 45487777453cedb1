"""Crashes: real processes killed for real lose at most one flush.

The child process (``helpers/crash_child.py``) runs a checkpointed job whose function appends
the ids it computed to a log file, so the test can count how often each id was computed. The run
that resumes after the killed ones runs in the test's process (``crash_child``'s run).
"""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from helpers import crash_child
from helpers.rows import Storage

from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.checkpoints.compaction import COMPACT_AT, COMPACT_FANOUT
from checkpoint_assets.engine.plan.inputs import Prepared
from checkpoint_assets.engine.rows import SEQ

CHILD = Path(crash_child.__file__)
ROWS = 240
INTERVAL = 4


def _spec(storage: Storage, tmp_path: Path, run_label: int, **overrides: Any) -> dict[str, Any]:
    base_dir, options = storage
    spec = {
        "mode": "materialize",
        "base_dir": base_dir,
        "options": options,
        "rows": ROWS,
        "interval": INTERVAL,
        "delay": 0.01,
        "flush_seconds": 30.0,
        "min_flush_seconds": 0.0,
        "log": str(tmp_path / "computed.log"),
        "run": run_label,
        "report": str(tmp_path / f"report-{run_label}.json"),
    }
    spec.update(overrides)
    return spec


def _settings_of(spec: dict[str, Any]) -> Settings:
    """The settings the child runs with, for their loss bound."""
    return Settings(
        id_column="ticket_id",
        checkpoint_interval=spec["interval"],
        batch_size=spec.get("batch_size"),
        max_concurrency=spec.get("max_concurrency", 1),
        min_flush_seconds=spec["min_flush_seconds"],
    )


def _start(spec: dict[str, Any], tmp_path: Path) -> subprocess.Popen[bytes]:
    err = open(tmp_path / f"child-{spec['run']}.err", "wb")  # noqa: SIM115 - kept by the child
    return subprocess.Popen(
        [sys.executable, str(CHILD), json.dumps(spec)], stdout=subprocess.DEVNULL, stderr=err
    )


def _log(tmp_path: Path) -> list[tuple[int, int]]:
    path = tmp_path / "computed.log"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [(int(r), int(i)) for r, i in (line.split("\t") for line in lines if "\t" in line)]


def _wait_for_rows(child: subprocess.Popen[bytes], tmp_path: Path, run_label: int, n: int) -> None:
    """Wait until the child's run has computed at least ``n`` rows (and is still running)."""
    deadline = time.monotonic() + 120
    while sum(1 for r, _ in _log(tmp_path) if r == run_label) < n:
        assert child.poll() is None, f"child exited early with {child.returncode}"
        assert time.monotonic() < deadline, "child made no progress"
        time.sleep(0.005)


def _resume_here(spec: dict[str, Any]) -> dict[str, Any]:
    """The run after the killed one, in this process (``crash_child``'s own run): what is
    proven is about the processes killed before it, so it needs no process of its own."""
    run = crash_child.run_materialize if spec["mode"] == "materialize" else crash_child.run_engine
    return run(spec)


def _stored(storage: Storage, name: str = "routed/default/all") -> pl.DataFrame:
    """Every stored row of the child's checkpoint (merged file and parts), unresolved."""
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), name)
    merged, watermark = checkpoint.read_merged()
    frames = [] if merged is None else [merged]
    for part in checkpoint.list_parts()[0]:
        if part.last > watermark:
            frames.append(checkpoint.read_file(part.path))
    return pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()


def _recomputed(log: list[tuple[int, int]], kills: int) -> tuple[dict[int, set[int]], list[int]]:
    """The runs that computed each id, and for each killed run the rows a later run computed
    again (what the kill lost)."""
    runs_of: dict[int, set[int]] = collections.defaultdict(set)
    for label, i in log:
        runs_of[i].add(label)
    lost = [
        sum(1 for labels in runs_of.values() if k in labels and max(labels) > k)
        for k in range(1, kills + 1)
    ]
    return runs_of, lost


# S3 under kills: test_kills.py's plan on S3 and its Dagster materialize on S3; the 32-in-flight
# kill and the SIGTERM flush through Dagster below run on S3 too.
LOCAL_ONLY = pytest.mark.parametrize("storage", ["local"], indirect=True)


@LOCAL_ONLY
def test_sigkill_mid_shard_loses_at_most_one_interval_and_the_flush_in_flight(
    storage: Storage, tmp_path: Path
) -> None:
    kills = 3
    for label in range(1, kills + 1):
        spec = _spec(storage, tmp_path, label)
        child = _start(spec, tmp_path)
        _wait_for_rows(child, tmp_path, label, 40)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    final = _spec(storage, tmp_path, kills + 1)
    assert _resume_here(final)["success"]

    log = _log(tmp_path)
    runs_of, lost = _recomputed(log, kills)
    print(f"rows recomputed after each of {kills} SIGKILLs: {lost} (interval {INTERVAL})")
    # The documented bound: the buffer, the flush the writer may have been writing when the
    # kill came and the calls in flight (about one interval each while storage keeps up: a
    # 4-row part is written in ~1 ms locally, slower on S3).
    bound = _settings_of(final).loss_bound().rows
    assert all(n <= bound for n in lost), (lost, bound)
    assert len(log) == ROWS + sum(lost)
    assert sorted(runs_of) == list(range(ROWS))
    killed_work = sum(1 for labels in runs_of.values() if min(labels) <= kills)
    assert killed_work >= 3 * 40 - sum(lost), "the killed runs' flushed work was resumed"

    stored = _stored(storage)
    assert stored.height == ROWS
    assert sorted(stored["ticket_id"]) == list(range(ROWS))
    assert stored["_error"].null_count() == ROWS


def test_sigkill_with_one_row_calls_and_32_in_flight_loses_at_most_the_bound(
    storage: Storage, tmp_path: Path
) -> None:
    """Group commit under concurrent completion: one-row calls, 32 in flight, a flush every 64
    rows. A SIGKILL loses at most what the sink's docstring promises; nothing is duplicated."""
    rows, interval, batch, in_flight = 1200, 64, 1, 32
    kills = 1 if storage[0].startswith("s3://") else 2  # S3: one kill, for its slower flushes
    shape = {"rows": rows, "interval": interval, "batch_size": batch}
    shape |= {"max_concurrency": in_flight, "delay": 0.05}
    for label in range(1, kills + 1):
        spec = _spec(storage, tmp_path, label, **shape)
        child = _start(spec, tmp_path)
        _wait_for_rows(child, tmp_path, label, 300)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    final = _spec(storage, tmp_path, kills + 1, **shape)
    assert _resume_here(final)["success"]

    log = _log(tmp_path)
    _, lost = _recomputed(log, kills)
    bound = _settings_of(final).loss_bound().rows
    print(
        f"rows recomputed after each SIGKILL: {lost} (interval {interval}, {in_flight} in "
        f"flight, bound {bound})"
    )
    # Not durable at a kill: the buffer, the flush being written and the calls in flight.
    assert all(n <= bound for n in lost), (lost, bound)
    assert len(log) == rows + sum(lost)
    stored = _stored(storage)
    assert stored.height == rows, "a row is stored twice, or lost"
    assert sorted(stored["ticket_id"]) == list(range(rows))
    assert stored["_error"].null_count() == rows


def _sigterm_then_resume(storage: Storage, tmp_path: Path, mode: str) -> dict[str, Any]:
    # Flushes are due only every 10**6 rows or seconds: only the SIGTERM flush can store rows.
    slow = {"mode": mode, "rows": 96, "delay": 0.02, "flush_seconds": 1e6, "min_flush_seconds": 1e6}
    spec = _spec(storage, tmp_path, 1, **slow)
    child = _start(spec, tmp_path)
    _wait_for_rows(child, tmp_path, 1, 24)
    child.send_signal(signal.SIGTERM)
    child.wait(timeout=60)

    logged = {i for _, i in _log(tmp_path)}
    stored = _stored(storage)
    assert stored.height > 0, "SIGTERM must flush the buffered rows"
    stored_ids = set(stored["ticket_id"])
    assert stored_ids <= logged
    assert len(stored_ids) >= len(logged) - INTERVAL  # at most the interrupted call is lost
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), "routed/default/all")
    assert checkpoint.store.get_or_none(checkpoint.files.lock) is None, "lock released"

    again = _spec(storage, tmp_path, 2, mode=mode, rows=96)
    _resume_here(again)
    second = {i for r, i in _log(tmp_path) if r == 2}
    assert not second & stored_ids, "flushed rows are not computed again"
    assert second | stored_ids == set(range(96))
    report: dict[str, Any] = (
        json.loads(Path(spec["report"]).read_text()) if Path(spec["report"]).exists() else {}
    )
    return report


def test_sigterm_during_materialize_flushes_buffered_rows(storage: Storage, tmp_path: Path) -> None:
    # Dagster maps SIGTERM to its SIGINT handler, which raises DagsterExecutionInterruptedError
    # inside the step: the run fails, and the engine flushes on the way out.
    report = _sigterm_then_resume(storage, tmp_path, "materialize")

    assert report["success"] is False
    assert any("DagsterExecutionInterruptedError" in f for f in report["failures"])


@LOCAL_ONLY
def test_sigterm_to_the_engine_outside_dagster_flushes_buffered_rows(
    storage: Storage, tmp_path: Path
) -> None:
    _sigterm_then_resume(storage, tmp_path, "engine")


# -- crash-safe finalize and sequence numbers (engine level, in process) ----------------------

SETTINGS = Settings(
    id_column="ticket_id",
    input_columns=("body",),
    checkpoint_interval=4,
    min_flush_seconds=0.0,  # a flush every 4 rows on S3 too
    retry_delay_seconds=0.0,
)


@pytest.fixture
def one_part_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests below count parts: make each flush wait for the one being written instead of
    letting rows done meanwhile join the next one (group commit), so a part holds one interval.
    (Not the kill tests above: their loss bound is computed from the real settings.)"""
    monkeypatch.setattr(Settings, "max_unflushed_rows", property(lambda s: 1))


class Crash(BaseException):
    """Stands for the process dying inside the function (nothing catches it)."""


def _inputs(n: int) -> Prepared:
    ids = list(range(n))
    return prepare(pl.DataFrame({"ticket_id": ids, "body": [f"b{i}" for i in ids]}), SETTINGS)


def _fn(calls: list[int], crash_after: int | None = None) -> Any:
    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        if crash_after is not None and len(calls) >= crash_after:
            raise Crash()
        calls.append(batch.height)
        return batch.select("ticket_id", route=pl.col("body").str.to_uppercase())

    return fn


def _checkpoint(storage: Storage, name: str = "job") -> Checkpoint:
    base_dir, options = storage
    return Checkpoint(open_store(base_dir, options), name)


def _crash_run(checkpoint: Checkpoint, n: int, calls: int, settings: Settings = SETTINGS) -> None:
    with pytest.raises(Crash):
        run(_fn([], crash_after=calls), _inputs(n), checkpoint, settings, job={"v": 1})


def _part_files(checkpoint: Checkpoint) -> dict[str, bytes]:
    return {
        f.path: checkpoint.store.get(f.path) for f in checkpoint.store.list(checkpoint.files.parts)
    }


@pytest.mark.usefixtures("one_part_per_interval")
def test_crash_between_merged_write_and_part_delete_resumes_to_the_same_result(
    storage: Storage,
) -> None:
    clean, _ = run(_fn([]), _inputs(20), _checkpoint(storage, "clean"), SETTINGS, job={"v": 1})
    checkpoint = _checkpoint(storage)
    _crash_run(checkpoint, 20, calls=3)
    parts = _part_files(checkpoint)
    assert len(parts) == 3
    # Finalize writes the merged file, then deletes the parts; put them back as if the process
    # died between the two steps.
    checkpoint.finalize("ticket_id", _inputs(20).keys["ticket_id"])
    for path, data in parts.items():
        checkpoint.store.put(path, data)
    calls: list[int] = []

    result, stats = run(_fn(calls), _inputs(20), _checkpoint(storage), SETTINGS, job={"v": 1})

    assert sum(calls) == 8 and stats.rows_resumed == 12
    assert result.sort("ticket_id").equals(clean.sort("ticket_id"))
    merged, _ = checkpoint.read_merged()
    assert merged is not None and sorted(merged["ticket_id"]) == list(range(20))
    assert _part_files(checkpoint) == {}


@pytest.mark.usefixtures("one_part_per_interval")
def test_crash_after_compaction_before_deleting_its_inputs_is_harmless(storage: Storage) -> None:
    one_per_flush = Settings(**{**SETTINGS.__dict__, "checkpoint_interval": 1})
    rows = COMPACT_AT + 4
    checkpoint = _checkpoint(storage)
    _crash_run(checkpoint, rows, calls=COMPACT_AT - 1, settings=one_per_flush)
    before = _part_files(checkpoint)
    # The next flush brings the count to COMPACT_AT, which merges the oldest eight parts.
    _crash_run(_checkpoint(storage), rows, calls=1, settings=one_per_flush)
    after = _part_files(checkpoint)
    assert len(after) == COMPACT_AT - COMPACT_FANOUT + 1
    for path, data in before.items():  # as if the compaction's deletes never happened
        if path not in after:
            checkpoint.store.put(path, data)
    calls: list[int] = []

    result, stats = run(
        _fn(calls), _inputs(rows), _checkpoint(storage), one_per_flush, job={"v": 1}
    )

    assert (sum(calls), stats.rows_resumed) == (rows - COMPACT_AT, COMPACT_AT)
    assert sorted(result["ticket_id"]) == list(range(rows))
    merged, _ = checkpoint.read_merged()
    assert merged is not None and merged["ticket_id"].n_unique() == merged.height == rows


@pytest.mark.usefixtures("one_part_per_interval")
def test_sequence_numbers_continue_after_the_highest_one_across_restarts(storage: Storage) -> None:
    checkpoint = _checkpoint(storage)
    _crash_run(checkpoint, 40, calls=3)
    _crash_run(_checkpoint(storage), 40, calls=2)

    assert [p.first for p in checkpoint.list_parts()[0]] == [1, 2, 3, 4, 5]
    run(_fn([]), _inputs(40), _checkpoint(storage), SETTINGS, job={"v": 1})
    merged, watermark = checkpoint.read_merged()
    assert merged is not None
    assert watermark == merged[SEQ].max() == 10  # 5 more flushes finished the 40 rows

    _crash_run(_checkpoint(storage), 48, calls=1)  # 8 new rows: one flush, then the crash
    assert [p.first for p in checkpoint.list_parts()[0]] == [watermark + 1]


class _RecordingCheckpoint(Checkpoint):
    """A checkpoint that records the size of every part it writes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.written: list[int] = []

    def write_part(self, rows: pl.DataFrame, first: int, last: int | None = None, **kw: Any) -> Any:
        part = super().write_part(rows, first, last, **kw)
        self.written.append(rows.height)
        return part


@pytest.mark.usefixtures("one_part_per_interval")
def test_the_last_rows_go_into_the_merged_file_without_a_part(storage: Storage) -> None:
    base_dir, options = storage
    checkpoint = _RecordingCheckpoint(open_store(base_dir, options), "job")

    result, stats = run(_fn([]), _inputs(10), checkpoint, SETTINGS, job={"v": 1})

    assert checkpoint.written == [4, 4]  # the last 2 rows are written once, by finalize
    assert stats.flushes == 3
    merged, watermark = checkpoint.read_merged()
    assert merged is not None and sorted(merged["ticket_id"]) == list(range(10))
    assert watermark == merged[SEQ].max() == 3
    assert sorted(result["ticket_id"]) == list(range(10))
    assert _part_files(checkpoint) == {}


@pytest.mark.usefixtures("one_part_per_interval")
def test_a_failed_finalize_still_stores_the_last_rows_as_a_part(tmp_path: Path) -> None:
    checkpoint = Checkpoint(open_store(str(tmp_path)), "job")
    blocker = Path(checkpoint.files.merged)
    route = _fn([])

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        if 9 in batch["ticket_id"]:  # the last call: from now on the merged file can't be written
            blocker.mkdir()
        return route(batch)  # type: ignore[no-any-return]

    with pytest.raises(IsADirectoryError):
        run(fn, _inputs(10), checkpoint, SETTINGS, job={"v": 1})

    blocker.rmdir()
    assert sorted(p.first for p in checkpoint.list_parts()[0]) == [1, 2, 3]  # 4 + 4 + 2 rows
    calls: list[int] = []
    _, stats = run(
        _fn(calls), _inputs(10), _checkpoint((str(tmp_path), {})), SETTINGS, job={"v": 1}
    )
    assert (calls, stats.rows_resumed) == ([], 10)
