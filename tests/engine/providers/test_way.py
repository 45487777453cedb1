"""A provider job's way (``job.Way``): its mode, a hybrid run's deadline and whether it waits,
read by one constructor from what a user writes, alone (the asset's arguments, a run config) or
over the asset's way (a run)."""

from __future__ import annotations

from typing import Any

import pytest

from checkpoint_assets.engine.providers.job import Mode, ProviderJob, Way, seconds_of


def test_what_a_user_writes_is_read_into_a_typed_way() -> None:
    assert Way.of() == Way() == Way(Mode.batch, None, True)
    assert Way.of("hybrid", "1h30m") == Way(Mode.hybrid, 5400.0, True)
    assert Way.of("online", wait=False) == Way(Mode.online, None, False)
    assert [seconds_of(d) for d in (90, 2.5, "90", "15m", "2.5s", " 1h30m ")] == [
        90.0,
        2.5,
        90.0,
        900.0,
        2.5,
        5400.0,
    ]


@pytest.mark.parametrize(
    ("written", "said"),
    [
        ({"mode": "fast"}, "mode must be one of online, batch, hybrid, got 'fast'"),
        ({"mode": "hybrid", "deadline": "soon"}, "deadline must be seconds or a duration"),
        ({"deadline": True}, "deadline must be seconds or a duration"),
        ({"mode": "hybrid", "deadline": -5}, "deadline must be at least 0 seconds"),
        ({"mode": "hybrid", "wait": False}, "mode hybrid finishes rows online in the run"),
    ],
)
def test_a_way_that_breaks_a_rule_is_refused_with_its_reason(
    written: dict[str, Any], said: str
) -> None:
    with pytest.raises(ValueError, match=said):
        Way.of(**written)


def test_a_way_made_directly_keeps_the_rules() -> None:
    with pytest.raises(ValueError, match="mode hybrid finishes rows online in the run"):
        Way(Mode.hybrid, wait=False)
    with pytest.raises(ValueError, match="deadline must be at least 0 seconds"):
        Way(Mode.hybrid, -1.0)


def test_a_run_takes_the_assets_way_where_it_says_nothing() -> None:
    asset = Way.of("hybrid", "15m")
    assert Way.of(over=asset) == asset
    assert Way.of(deadline="1m", over=asset) == Way(Mode.hybrid, 60.0, True)
    # The asset's deadline stands for its hybrid runs; a batch run does not follow it.
    assert Way.of("batch", wait=False, over=asset) == Way(Mode.batch, 900.0, False)
    assert Way.of("hybrid", over=Way.of("batch", 60)) == Way(Mode.hybrid, 60.0, True)


def test_a_deadline_a_run_sets_needs_mode_hybrid() -> None:
    said = "Run config sets a deadline, which only mode hybrid follows, but this run's mode is"
    with pytest.raises(ValueError, match=f"{said} batch"):
        Way.of(deadline=60, over=Way())
    with pytest.raises(ValueError, match=f"{said} online"):
        Way.of("online", "1m", over=Way.of("hybrid"))
    with pytest.raises(ValueError, match="mode hybrid finishes rows online in the run"):
        Way.of(wait=False, over=Way.of("hybrid"))
    # Alone, a deadline is the asset's, for the runs that run config makes hybrid.
    assert Way.of(deadline=60) == Way(Mode.batch, 60.0, True)


def test_a_job_that_sends_rows_online_needs_send() -> None:
    def request(row: dict[str, Any]) -> dict[str, Any]:
        return row

    provider: Any = object()
    with pytest.raises(ValueError, match="mode online sends rows online: it needs send"):
        ProviderJob(provider, request, request, Way(Mode.online))
    assert ProviderJob(provider, request, request).way == Way()
