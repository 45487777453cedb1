"""Each error says what to do in the terms of the layer that raises it: the engine's (settings,
the CLI) or Dagster's (run config keys, ``code_version``, the sensor). A remedy given where the
error was raised says more than its class's, so it is kept in both."""

from __future__ import annotations

import pickle

from checkpoint_assets.engine.errors import (
    BudgetExceededError,
    CorruptCheckpointError,
    JobChangedError,
    JobMismatchError,
    TooManyFailuresError,
)


def test_the_dagster_layer_words_a_class_remedy_in_run_config_keys() -> None:
    error = JobMismatchError("ckpt", "Checkpoint ckpt was written by a different job.")
    assert "resume=False" in str(error)
    assert "`resume: false`" in str(error.in_dagster_terms())
    assert "resume=False" not in str(error)


def test_a_remedy_given_where_the_error_was_raised_is_kept_in_dagster_terms() -> None:
    cast = JobMismatchError("ckpt", "The ids are Int64 now.").advise("Cast the ids back.")
    assert cast.in_dagster_terms().remedy == "Cast the ids back."
    damaged = CorruptCheckpointError("part", "is unreadable", "Run checkpoint-assets repair.")
    assert damaged.in_dagster_terms().remedy == "Run checkpoint-assets repair."
    assert "`checkpoint_tag`" in CorruptCheckpointError("part", "is odd").in_dagster_terms().remedy


def test_a_remedy_names_the_values_of_the_error() -> None:
    changed = JobChangedError("ckpt", {"code_version": ("v1", "v2"), "resume": (True, False)})
    assert "set code_version back to 'v1'" in changed.remedy
    dagster = changed.in_dagster_terms().remedy
    assert "the asset's `code_version` back to 'v1' and `resume` back to True" in dagster
    budget = BudgetExceededError("a", "max_asset_cost", 1.0, 1.2, 10)
    assert budget.remedy.startswith("Raise max_asset_cost")
    assert "`budget: {max_asset_cost: <USD>}`" in budget.in_dagster_terms().remedy


def test_several_shards_failing_say_the_remedy_of_what_most_failed_rows_are() -> None:
    failing = TooManyFailuresError("s0", 10, 100, 0.0, "boom")
    missing = TooManyFailuresError("s1", 30, 100, 0.0, "", no_result=30, no_result_ids=[1, 2])
    assert "raise `max_failed_fraction`" in failing.in_dagster_terms().remedy
    combined = TooManyFailuresError.of_several([failing, missing])
    assert combined.missing_results
    assert combined.remedy.startswith("Make the function return one row per input id")


def test_the_wording_survives_a_trip_between_processes() -> None:
    error = JobMismatchError("ckpt", "Another job.").in_dagster_terms()
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error) and "`resume: false`" in str(again)
