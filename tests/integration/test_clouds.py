"""Checkpoints on the object stores other than S3, over real HTTP to emulators on 127.0.0.1: GCS
(``gs://``, fake-gcs-server) and Azure Blob (``az://``, Azurite; ``helpers/clouds.py``). On
each, a killed run resumes from what it flushed and finalizes, of two runs racing for the lock's
conditional create exactly one writes, and the CLI reads it with the documented options.

S3 (moto) has the same checks elsewhere: killed runs in reliability/test_kills.py, racing
creates in engine/storage/test_storage.py, a writer refused by a held lock in
engine/loop/test_lock.py, the CLI in integration/test_s3.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from helpers.jobs import ASSET, Storage, build_job, parts_by_partition, route, stats, tickets

from checkpoint_assets.cli import main as cli

pytestmark = pytest.mark.object_store
HERE = Path(__file__).parent
TESTS = Path(__file__).parents[1]


@pytest.fixture(params=["gcs", "azure"])
def store(request: pytest.FixtureRequest) -> Storage:
    """(base_dir, storage_options) in a fresh bucket (GCS) or container (Azure)."""
    server = request.getfixturevalue(f"{request.param}_server")
    return server.new_storage()  # type: ignore[no-any-return]


def _slow_route(batch: pl.DataFrame) -> pl.DataFrame:
    time.sleep(0.005 * batch.height)  # 200 rows per second, whatever the batch size
    return route(batch)


def _slow_child(base_dir: str, options: str, rows: str) -> None:
    """(child process) Say ready, wait for a line on stdin, then materialize a slow job."""
    job = build_job(
        (base_dir, json.loads(options)),
        tickets(int(rows)),
        fn=_slow_route,
        min_flush_seconds=0,
        # About 15 parts per run: fake-gcs-server stalled on a DELETE once a run had written
        # ~130 parts (seen at finalize, with one writer).
        checkpoint_interval=40,
    )
    print("ready", flush=True)
    sys.stdin.readline()
    job.materialize()


def _child(storage: Storage, rows: int) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, test_clouds; test_clouds._slow_child(*sys.argv[1:])",
            storage[0],
            json.dumps(storage[1]),
            str(rows),
        ],
        cwd=HERE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(TESTS), *sys.path])},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready", child.stderr
    return child


def _go(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.write("go\n")
    child.stdin.flush()


def test_a_killed_run_resumes_from_what_it_flushed_and_finalizes(store: Storage) -> None:
    job = build_job(store, tickets(2000), checkpoint_interval=40)
    checkpoint = job.checkpoint()
    child = _child(store, 2000)
    _go(child)
    deadline = time.monotonic() + 120
    while len(checkpoint.list_parts()[0]) < 3:
        assert child.poll() is None, f"the child ended before it was killed: {child.stderr}"
        assert time.monotonic() < deadline, "the child flushed no parts within 120 s"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    stored = checkpoint.load("ticket_id").rows.get_column("ticket_id")
    assert 0 < stored.len() < 2000
    assert checkpoint.store.get_or_none(checkpoint.files.lock) is not None  # the dead run's lock

    again = stats(job.materialize())

    assert again["rows_resumed"] == stored.len()
    assert again["rows_computed"] == 2000 - stored.len()
    assert not set(job.computed_ids()) & set(stored.to_list())
    names = sorted(p.removeprefix(checkpoint.store.root + "/") for p in job.files())
    assert names == [f"{ASSET}/default/all.parquet", f"{ASSET}/default/all.parquet.meta.json"]
    result = checkpoint.read_result("ticket_id", ["route"])
    assert result.sort("ticket_id").equals(
        route(tickets(2000)).with_columns(pl.lit(None, pl.String).alias("_error"))
    )


def test_two_runs_started_together_one_writes_the_other_is_refused(store: Storage) -> None:
    # 600 rows take the winner ~3 s: the loser tries while the winner is surely still running.
    runs = [_child(store, 600) for _ in range(2)]
    for run in runs:  # both race for the lock's conditional create
        _go(run)
    outcomes = [run.communicate(timeout=120) for run in runs]

    codes = sorted(run.returncode for run in runs)
    assert codes[0] == 0 and codes[1] != 0, outcomes
    refused = next(err for run, (_, err) in zip(runs, outcomes, strict=True) if run.returncode)
    assert "is being written by another writer" in refused
    assert "LockHeldError" in refused
    result = build_job(store, tickets(600)).checkpoint().read_result("ticket_id", ["route"])
    assert result.height == 600


def test_the_cli_reads_a_checkpoint_with_the_documented_options(
    store: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    base_dir, options = store
    build_job(store, tickets(20)).materialize()
    # As docs/operations.md writes them: -o endpoint_url=... -o token=anon (GCS),
    # -o connection_string=... (Azure).
    flags = [f"-o{key}={value}" for key, value in options.items()]

    assert cli(["status", base_dir, *flags]) == 0
    assert parts_by_partition(capsys.readouterr().out) == {"all": "0"}
    assert cli(["verify", base_dir, *flags]) == 0
