"""Fingerprints: results of one job are never mixed with another's."""

from __future__ import annotations

import json

import polars as pl
import pytest
from helpers.jobs import Storage, build_job, stats, tickets

from checkpoint_assets import JobMismatchError
from checkpoint_assets.engine import Settings, prepare
from checkpoint_assets.engine.rows import INPUT_HASH
from checkpoint_assets.engine.sharding import hashing


def _assert_names_remedies(message: str) -> None:
    assert "different job" in message
    assert "resume: false" in message
    assert "checkpoint_tag" in message


def test_changed_code_version_is_refused_until_resume_false(storage: Storage) -> None:
    old = build_job(storage, tickets(12), code_version="1")
    old.materialize()
    new = build_job(storage, tickets(12), code_version="2", instance=old.instance)
    before = new.files()

    with pytest.raises(JobMismatchError) as raised:
        new.materialize()

    _assert_names_remedies(str(raised.value))
    assert "code_version" in str(raised.value)
    assert new.calls == []
    assert new.files() == before

    assert stats(new.materialize(resume=False))["rows_computed"] == 12
    new.calls.clear()
    assert stats(new.materialize())["rows_computed"] == 0
    assert new.calls == []


def test_changed_input_columns_are_refused(storage: Storage) -> None:
    old = build_job(storage, tickets(12), input_columns=["body"])
    old.materialize()
    new = build_job(storage, tickets(12), input_columns=["subject", "body"], instance=old.instance)

    with pytest.raises(JobMismatchError) as raised:
        new.materialize()

    _assert_names_remedies(str(raised.value))
    assert "input_columns" in str(raised.value)
    assert new.calls == []


def test_different_output_columns_are_refused_until_resume_false(storage: Storage) -> None:
    old = build_job(storage, tickets(12))
    old.materialize()

    def label(batch: pl.DataFrame) -> pl.DataFrame:
        return batch.select("ticket_id", label=pl.col("subject"))

    new = build_job(storage, tickets(16), fn=label, instance=old.instance)

    with pytest.raises(JobMismatchError) as raised:
        new.materialize()

    message = str(raised.value)
    assert "['label']" in message and "['route']" in message
    assert "resume: false" in message and "checkpoint_tag" in message

    result = new.materialize(resume=False)
    assert stats(result)["rows_computed"] == 16
    value = result.output_for_node("routed")
    assert value.columns == ["ticket_id", "label", "_error"]
    assert value.height == 16


def test_new_checkpoint_tag_keeps_a_separate_checkpoint(storage: Storage) -> None:
    old = build_job(storage, tickets(12), code_version="1")
    old.materialize()
    new = build_job(storage, tickets(12), code_version="2", instance=old.instance)

    tagged = new.materialize(checkpoint_tag="v2")

    assert stats(tagged)["rows_computed"] == 12
    new.calls.clear()
    assert stats(new.materialize(checkpoint_tag="v2"))["rows_computed"] == 0
    assert new.calls == []
    # The first job's checkpoint is still there and still its own.
    old.calls.clear()
    assert stats(old.materialize())["rows_computed"] == 0


def test_settings_that_do_not_change_results_may_change_between_runs(storage: Storage) -> None:
    job = build_job(storage, tickets(12), checkpoint_interval=4)
    job.materialize(limit=6)
    job.calls.clear()

    result = job.materialize(checkpoint_interval=5)

    assert stats(result)["rows_computed"] == 6
    assert [len(c) for c in job.calls] == [5, 1]


def test_input_fingerprint_is_recorded_and_ignores_row_order(storage: Storage) -> None:
    job = build_job(storage, tickets(12))
    first = stats(job.materialize())
    meta = json.loads(job.store().get(job.checkpoint().files.meta))

    assert meta["input_fingerprint"] == first["input_fingerprint"]
    job.set_input(tickets(12).reverse())
    assert stats(job.materialize())["input_fingerprint"] == first["input_fingerprint"]
    job.set_input(tickets(13))
    assert stats(job.materialize())["input_fingerprint"] != first["input_fingerprint"]


def test_each_stored_row_carries_the_hash_of_its_input() -> None:
    df = tickets(6)
    settings = Settings(id_column="ticket_id", input_columns=("subject", "body"))
    edited = df.with_columns(
        pl.when(pl.col("ticket_id") == 4).then(pl.lit("x")).otherwise("body").alias("body")
    )

    a = prepare(df, settings).get_column(INPUT_HASH).to_list()
    b = prepare(edited, settings).get_column(INPUT_HASH).to_list()

    assert [x != y for x, y in zip(a, b, strict=True)] == [False] * 4 + [True, False]
    assert hashing.fingerprint(prepare(df, settings)[INPUT_HASH].to_numpy()) != hashing.fingerprint(
        prepare(edited, settings)[INPUT_HASH].to_numpy()
    )


def test_reordering_columns_of_the_source_is_not_a_change(storage: Storage) -> None:
    job = build_job(storage, tickets(8), input_columns=["subject", "body"])
    job.materialize()
    job.calls.clear()
    job.set_input(tickets(8).select("body", "ticket_id", "subject"))

    assert stats(job.materialize())["rows_computed"] == 0
    assert job.calls == []
