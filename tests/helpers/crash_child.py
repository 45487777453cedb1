"""Child process for the crash tests: one checkpointed run over ``rows`` rows, killable.

Usage: ``python crash_child.py SPEC_JSON`` where the spec holds ``mode`` ("materialize": the
asset through Dagster's ``materialize``; "engine": ``checkpoint_assets.engine.run`` alone),
``base_dir``, ``options`` (storage options), ``rows``, ``interval``, ``batch_size`` and
``max_concurrency`` (optional), ``delay`` (seconds each call takes), ``flush_seconds``,
``min_flush_seconds``, ``log`` (a file each call appends ``<run>\\t<id>`` lines to, after
computing and before returning), ``run`` (a label) and ``report`` (a JSON file written when the
run returns).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import polars as pl

CHECKPOINT = "routed"


def source(rows: int) -> pl.DataFrame:
    ids = list(range(rows))
    return pl.DataFrame({"ticket_id": ids, "body": [f"b{i}" for i in ids]})


def make_fn(spec: dict[str, Any]) -> Any:
    fd = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        time.sleep(spec["delay"])
        ids = batch.get_column("ticket_id").to_list()
        os.write(fd, "".join(f"{spec['run']}\t{i}\n" for i in ids).encode())
        return batch.select("ticket_id", route=pl.col("body").str.to_uppercase())

    return fn


def settings_of(spec: dict[str, Any]) -> dict[str, Any]:
    """The settings of the run, either mode: keywords of ``checkpointed_asset`` and ``Settings``."""
    return {
        "id_column": "ticket_id",
        "checkpoint_interval": spec["interval"],
        "batch_size": spec.get("batch_size"),
        "max_concurrency": spec.get("max_concurrency", 1),
        "flush_seconds": spec["flush_seconds"],
        "min_flush_seconds": spec["min_flush_seconds"],
        "retry_delay_seconds": 0.0,
    }


def run_materialize(spec: dict[str, Any]) -> dict[str, Any]:
    import dagster as dg

    from checkpoint_assets import CheckpointIOManager, checkpointed_asset

    @dg.asset(name="tickets", io_manager_key="source_io")
    def tickets() -> pl.DataFrame:
        return source(spec["rows"])

    fn = make_fn(spec)

    @checkpointed_asset(source="tickets", name=CHECKPOINT, **settings_of(spec))
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        return fn(batch)  # type: ignore[no-any-return]

    result = dg.materialize(
        [tickets, routed],
        instance=dg.DagsterInstance.ephemeral(),
        resources={
            "io_manager": CheckpointIOManager(
                base_dir=spec["base_dir"], storage_options=spec["options"]
            ),
            "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
        },
        raise_on_error=False,
    )
    failures = [
        e.step_failure_data.error.message
        for e in result.get_step_failure_events()
        if e.step_failure_data.error is not None
    ]
    return {"success": result.success, "failures": failures}


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run

    settings = Settings(input_columns=("body",), **settings_of(spec))
    store = open_store(spec["base_dir"], spec["options"])
    checkpoint = Checkpoint(store, f"{CHECKPOINT}/default/all")
    result, _ = run(
        make_fn(spec),
        prepare(source(spec["rows"]), settings),
        checkpoint,
        settings,
        job={"test": "crash"},
    )
    return {"success": True, "rows": result.height}


def main() -> None:
    spec = json.loads(sys.argv[1])
    report = run_materialize(spec) if spec["mode"] == "materialize" else run_engine(spec)
    with open(spec["report"], "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
