"""Every setting is honoured or refused by name: none is silently replaced by another value.

A run config out of range fails when the step starts, before the source is read or anything is
computed or written, naming the key and its valid range; a decorator argument out of range fails
when the asset is defined.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from helpers.jobs import Job, build_job, stats, tickets

AT_LEAST = "Input should be greater than or equal to"  # pydantic's words for a bound


def job(tmp_path: Path, **asset_kwargs: Any) -> Job:
    return build_job((str(tmp_path / "checkpoints"), {}), tickets(12), **asset_kwargs)


def failure(result: dg.ExecuteInProcessResult) -> str:
    """The message of the step's failure, down to its cause."""
    [event] = [e for e in result.all_events if e.is_step_failure]
    assert event.step_failure_data is not None
    error = event.step_failure_data.error
    assert error is not None
    while error.cause is not None:
        error = error.cause
    return error.message


@pytest.mark.parametrize(
    "config, said",
    [
        # The asset's own rule, as its decorator says it.
        ({"checkpoint_interval": 0}, "checkpoint_interval must be at least 1, got 0"),
        ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
        ({"budget": {"max_run_cost": -1}}, "max_run_cost must be 0 or more USD, got -1"),
        ({"limit": -1}, rf"limit\s+{AT_LEAST} 0"),
        (
            {"global_resume": True, "resume": False},
            r"global_resume: true takes finished rows .* resume: false computes every row again",
        ),
    ],
    ids=[
        "checkpoint_interval-0",
        "batch_size-0",
        "max_run_cost-negative",
        "limit-negative",
        "global_resume-without-resume",
    ],
)
def test_a_run_config_out_of_range_fails_before_any_work_naming_the_key(
    tmp_path: Path, config: dict[str, Any], said: str
) -> None:
    routed = job(tmp_path)

    result = routed.materialize(raise_on_error=False, **config)

    assert not result.success
    assert routed.calls == []
    assert re.search(said, failure(result), flags=re.S), failure(result)
    assert not (tmp_path / "checkpoints").exists()  # nothing written


def test_run_config_values_override_the_asset_s_including_the_smallest(tmp_path: Path) -> None:
    routed = job(tmp_path, checkpoint_interval=8, batch_size=4)

    result = routed.materialize(checkpoint_interval=1, batch_size=1, limit=0)
    assert stats(result)["rows_total"] == 0  # limit: 0 processes no row
    routed.materialize(checkpoint_interval=1, batch_size=1)

    assert [len(call) for call in routed.calls] == [1] * 12
    assert stats(routed.materialize())["rows_resumed"] == 12


@pytest.mark.parametrize(
    "argument, value, said",
    [
        ("max_attempts", 0, "max_attempts must be at least 1, got 0"),
        ("retry_delay_seconds", -1.0, "retry_delay_seconds must be at least 0, got -1.0"),
        ("flush_seconds", -1.0, "flush_seconds must be at least 0, got -1.0"),
        ("min_flush_seconds", -0.5, "min_flush_seconds must be at least 0, got -0.5"),
        ("max_failed_fraction", 1.5, "max_failed_fraction must be between 0 and 1, got 1.5"),
        ("checkpoint_interval", 0, "checkpoint_interval must be at least 1, got 0"),
    ],
)
def test_an_asset_argument_out_of_range_is_refused_when_the_asset_is_defined(
    tmp_path: Path, argument: str, value: Any, said: str
) -> None:
    with pytest.raises(ValueError, match=said):
        job(tmp_path, **{argument: value})
