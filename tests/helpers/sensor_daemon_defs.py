"""The asset and sensor of ``helpers.sensor_defs`` for the daemon test (``test_sensor.py``), each
run's steps in the run's own process (``in_process_executor``): the test watches the runs the
daemon launches, not how a run spreads its steps over processes."""

from __future__ import annotations

import dagster as dg

from checkpoint_assets import CheckpointIOManager
from helpers.sensor_defs import retries, scored, tickets

defs = dg.Definitions(
    assets=[tickets, scored],
    sensors=[retries],
    resources={"io_manager": CheckpointIOManager()},
    executor=dg.in_process_executor,
)
