"""``checkpoint_assets.loss_bound``: the bound the kill tests hold runs to
(tests/reliability/test_kills.py, tests/e2e/test_crash.py), for an asset's own arguments."""

from __future__ import annotations

import pytest

from checkpoint_assets import LossBound, loss_bound
from checkpoint_assets.engine.settings import Settings


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"checkpoint_interval": 64, "batch_size": 1, "max_concurrency": 32},
        {"checkpoint_interval": 1000, "min_flush_seconds": 2.0},
    ],
)
def test_it_is_the_bound_of_the_runs_settings_on_either_store(arguments: dict) -> None:
    settings = Settings(id_column="ticket_id", **arguments)
    assert loss_bound(**arguments) == settings.loss_bound()
    # Object stores flush at most every 5 s unless min_flush_seconds says otherwise.
    assert loss_bound(200, object_store=True, **arguments) == settings.loss_bound(200, 5.0)


def test_the_figures_the_concepts_page_gives() -> None:
    assert loss_bound().rows == 158  # the defaults, locally
    bound = loss_bound(checkpoint_interval=64, batch_size=1, max_concurrency=32)
    assert bound == LossBound(buffered=160, writing=160, held=40, batch_rows=1)
    assert bound.rows == 360
    assert loss_bound(100, object_store=True).rows == 1062


def test_a_name_that_is_not_an_argument_of_the_asset_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"\['interval'\] is not one of them.*checkpoint_interval"):
        loss_bound(interval=64)
    with pytest.raises(ValueError, match="checkpoint_interval must be at least 1, got 0"):
        loss_bound(checkpoint_interval=0)
