"""Resume: a run computes only what the checkpoint does not hold, by id."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest
from helpers.jobs import Storage, build_job, run_logs, stats, tickets

from checkpoint_assets import CorruptCheckpointError, InputChangedError
from checkpoint_assets.engine.rows import SEQ


def test_second_run_after_success_computes_nothing(storage: Storage) -> None:
    job = build_job(storage, tickets(30))
    first = stats(job.materialize())
    assert (first["rows_computed"], first["rows_resumed"]) == (30, 0)
    job.calls.clear()

    second = stats(job.materialize())

    assert (second["rows_computed"], second["rows_resumed"], second["rows_total"]) == (0, 30, 30)
    assert job.calls == []


def test_each_materialization_records_what_the_run_did(storage: Storage) -> None:
    job = build_job(storage, tickets(10))
    job.materialize(limit=4)

    meta = stats(job.materialize())

    assert {k: meta[k] for k in ("rows_total", "rows_computed", "rows_resumed")} == {
        "rows_total": 10,
        "rows_computed": 6,
        "rows_resumed": 4,
    }
    assert (meta["rows_failed"], meta["rows_reused"], meta["rows_dropped"]) == (0, 0, 0)
    assert (meta["calls"], meta["rows_imported"]) == (2, 0)  # 6 rows, interval 4
    assert meta["checkpoint_path"].endswith("routed/default/all.parquet")
    assert meta["checkpoint_tag"] == "default"
    assert len(meta["input_fingerprint"]) == 32
    assert meta["rows_per_second"] > 0


def test_resume_picks_up_by_id_after_the_input_is_reordered(storage: Storage) -> None:
    job = build_job(storage, tickets(30))
    job.materialize()
    job.calls.clear()
    job.set_input(tickets(30).reverse())

    again = stats(job.materialize())

    assert again["rows_computed"] == 0
    assert job.calls == []


def test_changed_finished_row_fails_and_leaves_stored_work_untouched(storage: Storage) -> None:
    job = build_job(storage, tickets(20))
    job.materialize()
    before = job.files()
    job.calls.clear()
    job.set_input(
        tickets(20).with_columns(
            pl.when(pl.col("ticket_id").is_in([3, 11]))
            .then(pl.lit("edited"))
            .otherwise(pl.col("body"))
            .alias("body")
        )
    )

    with pytest.raises(InputChangedError) as raised:
        job.materialize()

    message = str(raised.value)
    assert "Checkpoint input fingerprint does not match current data." in message
    assert "2 of 20" in message
    assert "ids [3, 11]" in message
    assert job.calls == []
    assert job.files() == before


def test_on_input_change_recompute_recomputes_only_the_changed_row(storage: Storage) -> None:
    job = build_job(storage, tickets(20))
    job.materialize()
    job.calls.clear()
    job.set_input(
        tickets(20).with_columns(
            pl.when(pl.col("ticket_id") == 7)
            .then(pl.lit("edited"))
            .otherwise(pl.col("body"))
            .alias("body")
        )
    )

    result = job.materialize(on_input_change="recompute")

    assert job.computed_ids() == [7]
    assert stats(result)["rows_computed"] == 1
    assert stats(result)["rows_resumed"] == 19
    assert stats(result)["rows_changed"] == 1  # the metadata says why it was computed again
    value = result.output_for_node("routed")
    assert value.filter(pl.col("ticket_id") == 7)["route"].item() == "EDITED"
    assert value.height == 20


def test_grown_input_processes_new_ids_and_resumes_old_ones(storage: Storage) -> None:
    job = build_job(storage, tickets(20))
    job.materialize()
    job.calls.clear()
    job.set_input(tickets(28))

    result = job.materialize()

    assert sorted(job.computed_ids()) == list(range(20, 28))
    assert (stats(result)["rows_computed"], stats(result)["rows_resumed"]) == (8, 20)
    assert sorted(result.output_for_node("routed")["ticket_id"]) == list(range(28))


def test_shrunk_input_drops_rows_from_the_result_but_keeps_them_stored(storage: Storage) -> None:
    job = build_job(storage, tickets(20))
    job.materialize()
    job.calls.clear()
    job.set_input(tickets(20).filter(pl.col("ticket_id") >= 5))

    shrunk = job.materialize()

    assert stats(shrunk)["rows_dropped"] == 5
    assert stats(shrunk)["rows_computed"] == 0
    assert sorted(shrunk.output_for_node("routed")["ticket_id"]) == list(range(5, 20))
    warnings = [m for m in run_logs(shrunk, job.instance) if "not in the input" in m]
    assert warnings and "5 stored row(s)" in warnings[0]

    job.set_input(tickets(20))
    back = job.materialize()

    assert job.calls == []
    assert (stats(back)["rows_computed"], stats(back)["rows_resumed"]) == (0, 20)
    assert sorted(back.output_for_node("routed")["ticket_id"]) == list(range(20))


def test_resume_false_recomputes_everything_and_keeps_checkpointing(storage: Storage) -> None:
    job = build_job(storage, tickets(12))
    job.materialize()
    job.calls.clear()

    fresh = job.materialize(resume=False)

    assert sorted(job.computed_ids()) == list(range(12))
    assert (stats(fresh)["rows_computed"], stats(fresh)["rows_resumed"]) == (12, 0)
    job.calls.clear()
    assert stats(job.materialize())["rows_computed"] == 0
    assert job.calls == []


def test_checkpointing_false_writes_no_file(storage: Storage) -> None:
    job = build_job(storage, tickets(12))

    result = job.materialize(checkpointing=False)

    assert stats(result)["rows_computed"] == 12
    assert stats(result)["storage_wait_seconds"] == 0.0  # storage never held it up
    assert sorted(job.computed_ids()) == list(range(12))
    assert job.files() == {}


def test_limit_runs_a_prefix_and_a_full_run_finishes_the_rest(storage: Storage) -> None:
    job = build_job(storage, tickets(30))

    smoke = job.materialize(limit=10)

    assert sorted(job.computed_ids()) == list(range(10))
    assert smoke.output_for_node("routed").height == 10
    job.calls.clear()
    full = job.materialize()
    assert sorted(job.computed_ids()) == list(range(10, 30))
    assert (stats(full)["rows_computed"], stats(full)["rows_resumed"]) == (20, 10)


def test_an_unreadable_part_is_moved_aside_not_deleted_and_the_run_goes_on(
    storage: Storage,
) -> None:
    job = build_job(storage, tickets(20))
    job.materialize(limit=8)
    checkpoint = job.checkpoint()
    seq = checkpoint.read_merged()[1] + 1  # the next flush: a part at another number is a gap
    bad = checkpoint.store.path(
        f"{checkpoint.name}.parquet.parts", f"part-{seq:012d}-{seq:012d}-0badc0ffee00.parquet"
    )
    checkpoint.store.put(bad, b"PAR1 this is not parquet")
    job.calls.clear()

    result = job.materialize()

    assert sorted(job.computed_ids()) == list(range(8, 20))
    assert any("0badc0ffee00.parquet is unreadable" in m for m in run_logs(result, job.instance))
    assert checkpoint.store.get_or_none(bad) is None
    moved = checkpoint.store.list(checkpoint.files.quarantine)
    assert [checkpoint.store.get(f.path) for f in moved] == [b"PAR1 this is not parquet"]


def test_checkpoint_with_duplicate_ids_points_at_two_jobs_sharing_a_tag(storage: Storage) -> None:
    job = build_job(storage, tickets(20))
    job.materialize(limit=8)
    checkpoint = job.checkpoint()
    stored, watermark = checkpoint.read_merged()
    assert stored is not None
    foreign = pl.concat([stored.head(2), stored.head(2)]).with_columns(
        pl.lit(watermark + 1, pl.Int64).alias(SEQ)
    )
    checkpoint.write_part(foreign, watermark + 1)
    job.calls.clear()

    with pytest.raises(CorruptCheckpointError) as raised:
        job.materialize()

    message = str(raised.value)
    assert "duplicate ids" in message
    assert "two different jobs" in message.lower() and "checkpoint_tag" in message
    assert job.calls == []


def test_checkpoint_without_the_output_columns_points_at_two_jobs_sharing_a_tag(
    storage: Storage,
) -> None:
    job = build_job(storage, tickets(12))
    job.materialize(limit=8)
    checkpoint = job.checkpoint()
    seq = checkpoint.read_merged()[1] + 1
    other_job = (
        job.checkpoint()
        .load("ticket_id")
        .rows.head(3)
        .select("ticket_id", "_error", "_attempts", "_input_hash", score=pl.lit(0.5))
        .with_columns(pl.lit(seq, pl.Int64).alias(SEQ))
    )
    checkpoint.write_part(other_job, seq)
    job.calls.clear()

    with pytest.raises(CorruptCheckpointError) as raised:
        job.materialize()

    message = str(raised.value)
    assert "output columns ['route']" in message
    assert "two different jobs" in message.lower() and "checkpoint_tag" in message
    assert job.calls == []


@pytest.mark.slow
def test_compaction_keeps_unmerged_parts_bounded_over_a_long_run(storage: Storage) -> None:
    # One flush per row: 600 flushes span three compaction levels (8**3 = 512 flushes).
    rows = 600
    seen: list[int] = []
    holder: dict[str, Any] = {}

    def counting(batch: pl.DataFrame) -> pl.DataFrame:
        checkpoint = holder["checkpoint"]
        seen.append(len(checkpoint.store.list(checkpoint.files.parts)))
        return batch.select("ticket_id", route=pl.lit("x"))

    job = build_job(
        storage, tickets(rows), fn=counting, checkpoint_interval=1, min_flush_seconds=0.0
    )
    holder["checkpoint"] = job.checkpoint()

    result = job.materialize()

    assert stats(result)["rows_computed"] == rows
    assert len(seen) == rows
    assert max(seen) <= 64
    assert max(seen) > 8  # the run really did accumulate parts between compactions
    assert job.checkpoint().store.list(job.checkpoint().files.parts) == []
