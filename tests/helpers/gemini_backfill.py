"""A backfill through Gemini's Batch Mode and Vertex AI's batch prediction with SIGKILLs, and a
hybrid run past its deadline, for the figures of the docs:
``PYTHONPATH=tests:. python tests/helpers/gemini_backfill.py ROWS [hybrid]``.

On each backend (the fake of ``gemini_fake.py``, Vertex's files on fake-gcs-server), four shards
of ``ROWS / 4`` rows each run in a child process (``gemini_kill_child.py``): shard 0 is SIGKILLed
after its upload, shard 1 after its create, shard 2 halfway through its download, shard 3 runs
to the end. Then each shard runs again to the end. It prints what the fake counted (jobs created,
requests processed, rows whose request it answered twice) and the rows stored, each once.

``hybrid``: one shard of ``ROWS`` rows through ``provider_batch_asset`` in a real Dagster
materialization, mode ``hybrid`` with a deadline of 2 s on a job that would take 60 s: what the
fake was paid for (requests processed in the job and answered online) and the rows stored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

import polars as pl

from checkpoint_assets import GeminiResource
from checkpoint_assets.engine import Checkpoint, open_store
from examples.llm_batch.jobs import Settings
from helpers import gemini_kill_child
from helpers.gemini_fake import gcs, serve, service_account_file

POINTS = ("after_upload", "after_create", "downloading", "none")


def child(fields: dict[str, Any], base_dir: str, rows: int, shard: int, point: str) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    config = {"resource": fields, "base_dir": base_dir, "rows": rows, "shard": shard}
    command = [sys.executable, gemini_kill_child.__file__, json.dumps(config | {"point": point})]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode not in (0, -9):
        raise RuntimeError(done.stderr[-3000:])
    return done.returncode


def backend(
    stack: ExitStack, name: str, workdir: str, processing_delay: float = 1.0
) -> tuple[Any, dict[str, Any]]:
    """The fake and the ``GeminiResource`` fields that reach it: the Gemini API with every
    submission as a file (so that there is an upload), or Vertex AI."""
    settings = Settings(processing_delay=processing_delay)
    if name == "gemini":
        url, fake = stack.enter_context(serve(settings))
        return fake, {
            "model": "gemini-test",
            "base_url": url,
            "api_key": "local",
            "inline_max_bytes": 1,
        }
    storage, options = gcs().new_storage()
    url, fake = stack.enter_context(serve(settings, storage_options=options))
    key = service_account_file(os.path.join(workdir, "key.json"), url)
    os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = key
    return fake, {
        "model": "gemini-test",
        "base_url": url,
        "vertexai": True,
        "project": "test-project",
        "location": "us-central1",
        "gcs_prefix": storage.replace("/checkpoints", "/batches"),
        "storage_options": options,
    }


def backfill(rows: int) -> dict[str, dict[str, Any]]:
    per_shard = rows // 4
    found = {}
    for name in ("gemini", "vertex"):
        with ExitStack() as stack:
            workdir = stack.enter_context(tempfile.TemporaryDirectory())
            fake, fields = backend(stack, name, workdir)
            base_dir = os.path.join(workdir, "checkpoints")
            began = time.monotonic()
            codes = [child(fields, base_dir, per_shard, s, p) for s, p in enumerate(POINTS)]
            for shard in range(4):
                gemini_kill_child.run_shard(fields, base_dir, per_shard, shard)
            store = open_store(base_dir)
            ids = []
            for shard in range(4):
                checkpoint = Checkpoint(store, gemini_kill_child.name(shard))
                for path in checkpoint.data_files():
                    ids += pl.read_parquet(path, columns=["id"]).get_column("id").to_list()
            counted = fake.snapshot()
            per_id = fake.processed()
            found[name] = {
                "rows": rows,
                "killed_runs": codes.count(-9),
                "rows_stored": len(ids),
                "distinct_rows_stored": len(set(ids)),
                "jobs_created": counted["creates"],
                "uploads": counted["uploads"],
                "requests_processed": counted["processed"],
                "custom_ids_processed_twice": sum(1 for n in per_id.values() if n > 1),
                "rows_paid_twice": counted["paid_twice"],
                "seconds": round(time.monotonic() - began, 1),
            }
    return found


def hybrid(rows: int) -> dict[str, dict[str, Any]]:
    import dagster as dg

    from checkpoint_assets import CheckpointIOManager, provider_batch_asset, shard_partitions

    found = {}
    for name in ("gemini", "vertex"):
        with ExitStack() as stack:
            workdir = stack.enter_context(tempfile.TemporaryDirectory())
            fake, fields = backend(stack, name, workdir, processing_delay=60.0)

            @dg.asset(name="tickets", io_manager_key="source_io")
            def tickets() -> pl.DataFrame:
                return gemini_kill_child.tickets(rows, 0)

            @provider_batch_asset(
                source="tickets",
                id_column="id",
                parse=gemini_kill_child.parse,
                provider="gemini",
                input_columns=["body"],
                partitions_def=shard_partitions(1),
                poll_seconds=0.2,
                max_poll_seconds=0.5,
                max_concurrency=16,
            )
            def routed(row: dict[str, Any]) -> dict[str, Any]:
                return gemini_kill_child.request(row)

            base_dir = os.path.join(workdir, "checkpoints")
            result = dg.materialize(
                [tickets, routed],
                resources={
                    "io_manager": CheckpointIOManager(base_dir=base_dir),
                    "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
                    "gemini": GeminiResource(**fields),
                },
                partition_key="0-of-1",
                run_config={"ops": {"routed": {"config": {"mode": "hybrid", "deadline": "2s"}}}},
            )
            checkpoint = Checkpoint(open_store(base_dir), "routed/default/0-of-1")
            ids = [
                i
                for path in checkpoint.data_files()
                for i in pl.read_parquet(path, columns=["id"]).get_column("id").to_list()
            ]
            counted = fake.snapshot()
            found[name] = {
                "rows": rows,
                "success": result.success,
                "cancels": counted["cancels"],
                "processed_in_the_job": counted["processed"],
                "answered_online": counted["ok"],
                "rows_paid": counted["processed"] + counted["ok"],
                "rows_stored": len(ids),
                "distinct_rows_stored": len(set(ids)),
                "rows_paid_twice": counted["paid_twice"],
            }
    return found


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    figures = hybrid(count) if sys.argv[2:3] == ["hybrid"] else backfill(count)
    print(json.dumps(figures, indent=2))
