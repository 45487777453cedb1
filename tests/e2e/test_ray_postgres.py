"""deploy/ray end to end on one machine: every shard of a UI backfill runs as a Ray job.

Real processes on 127.0.0.1: a PostgreSQL server holds the instance (runs, events), moto's S3
server holds the checkpoints, a local Ray head runs the runs (dagster-ray's RayRunLauncher),
and `dagster dev` (webserver, daemon) serves the demo with deploy/ray/dagster.yaml as its
instance config. The backfill is launched through GraphQL as the UI launches it; one shard's Ray
job is stopped half-way; the instance's run retry resumes it from its checkpoint; the downstream
asset reads every shard back from S3.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from deploy_services import ROOT, dagster_dev, postgres_server, ray_head, unavailable
from helpers.graphql import launch_backfill

MODULE = "examples.ticket_routing.definitions"
SHARDS = [f"{i}-of-4" for i in range(4)]
TICKETS = 2000  # 500 rows a shard: 8 calls of 64 rows
LATENCY_MS = 1500  # per call: ~12 s of work a shard, a flush (every 5 s on S3) half-way
RAY_TAG = {"num_cpus": 0.5}  # four runs at once on the 2-CPU head
MAX_RETRIES = 2  # run_retries.max_retries in deploy/ray/dagster.yaml


def _dagster(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dagster", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def _wait(what: str, check: Callable[[], Any], timeout: float, log: Path) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out waiting for {what}; dagster dev log:\n" + log.read_text()[-4000:]
            )
        time.sleep(1)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_backfill_runs_each_shard_as_a_ray_job_and_a_stopped_job_resumes_on_retry(
    tmp_path: Path,
    new_s3_storage: Callable[[], tuple[str, dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for module, extra in [("dagster_ray", "ray"), ("dagster_postgres", "postgres")]:
        try:
            __import__(module)
        except ImportError:
            unavailable(f'{module} is not installed (pip install -e ".[{extra}]")')
    from ray.job_submission import JobStatus, JobSubmissionClient

    base_dir, options = new_s3_storage()
    endpoint = options["client_kwargs"]["endpoint_url"]
    bucket = base_dir.removeprefix("s3://").split("/")[0]
    demo = {
        "DEMO_TICKETS": str(TICKETS),
        "DEMO_LATENCY_MS": str(LATENCY_MS),
        "DEMO_ERROR_RATE": "0",
        "DEMO_SHARDS": str(len(SHARDS)),
    }
    s3 = {
        "CHECKPOINT_BASE_DIR": base_dir,
        "AWS_ACCESS_KEY_ID": options["key"],
        "AWS_SECRET_ACCESS_KEY": options["secret"],
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    # The Ray cluster knows only the demo's tuning: the launcher must pass Postgres and S3 on.
    passed_by_launcher = {*s3, "DAGSTER_PG_HOST", "DAGSTER_PG_PORT", "DAGSTER_PG_USER"}
    passed_by_launcher |= {"DAGSTER_PG_PASSWORD", "DAGSTER_PG_DB", "DAGSTER_HOME"}
    cluster_env = {k: v for k, v in os.environ.items() if k not in passed_by_launcher} | demo

    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "deploy" / "ray" / "dagster.yaml", home / "dagster.yaml")
    log = tmp_path / "dagster_dev.log"

    started = time.monotonic()
    with postgres_server() as pg, ray_head(cluster_env) as ray_address:
        env = {**os.environ, **demo, **s3, **pg, "DAGSTER_HOME": str(home)}
        env["RAY_ADDRESS"] = ray_address
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        ray = JobSubmissionClient(ray_address)

        _dagster(env, "asset", "materialize", "-m", MODULE, "--select", "tickets")
        with dagster_dev(env, log) as port:
            backfill_id = launch_backfill(
                port, SHARDS, "ticket_routing", {"dagster-ray/config": json.dumps(RAY_TAG)}
            )
            instance = dg.DagsterInstance.get()
            backfill = dg.RunsFilter(tags={"dagster/backfill": backfill_id})

            # Stop one shard's Ray job once it has flushed a part to S3, before it finishes.
            def shard_half_done() -> dg.DagsterRun | None:
                import boto3

                keys = [
                    o["Key"]
                    for page in boto3.client("s3", endpoint_url=endpoint)
                    .get_paginator("list_objects_v2")
                    .paginate(Bucket=bucket, Prefix="checkpoints/ticket_routing/default/")
                    for o in page.get("Contents", [])
                ]
                for run in instance.get_runs(backfill):
                    shard = run.tags["dagster/partition"]
                    parts = f"/{shard}.parquet.parts/"
                    merged = f"/{shard}.parquet"
                    if (
                        run.status == dg.DagsterRunStatus.STARTED
                        and any(parts in k for k in keys)
                        and not any(k.endswith(merged) for k in keys)
                    ):
                        return run
                return None

            stopped = _wait("a shard with a flushed part", shard_half_done, 180, log)
            assert ray.stop_job(f"dagster-run-{stopped.run_id}")
            stopped_shard = stopped.tags["dagster/partition"]

            def every_shard_done() -> list[dg.DagsterRun] | None:
                runs = instance.get_runs(backfill)
                succeeded = {
                    r.tags["dagster/partition"]
                    for r in runs
                    if r.status == dg.DagsterRunStatus.SUCCESS
                }
                for shard in set(SHARDS) - succeeded:
                    failed = [
                        r
                        for r in runs
                        if r.tags["dagster/partition"] == shard
                        and r.status == dg.DagsterRunStatus.FAILURE
                    ]
                    if len(failed) > MAX_RETRIES:  # the instance gave up on this shard
                        errors = [
                            e.dagster_event.step_failure_data.error.to_string()
                            for e in instance.all_logs(
                                failed[0].run_id, of_type=dg.DagsterEventType.STEP_FAILURE
                            )
                            if e.dagster_event and e.dagster_event.step_failure_data.error
                        ]
                        logs = ray.get_job_logs(f"dagster-run-{failed[0].run_id}")
                        pytest.fail(
                            f"shard {shard} failed {len(failed)} times: {errors}\n"
                            f"Ray job log:\n{logs[-3000:]}"
                        )
                done = succeeded == set(SHARDS) and all(r.is_finished for r in runs)
                return runs if done else None

            runs = _wait("every shard to succeed", every_shard_done, 300, log)
        backfill_seconds = time.monotonic() - started

        # The stopped shard failed, and the instance's run retry (a new run, same backfill)
        # resumed the rows its checkpoint held.
        by_shard = {s: [r for r in runs if r.tags["dagster/partition"] == s] for s in SHARDS}
        assert instance.get_run_by_id(stopped.run_id).status == dg.DagsterRunStatus.FAILURE
        retry = next(r for r in by_shard[stopped_shard] if r.status == dg.DagsterRunStatus.SUCCESS)
        assert retry.tags.get("dagster/parent_run_id") == stopped.run_id
        for shard, shard_runs in by_shard.items():
            if shard != stopped_shard:
                assert [r.status for r in shard_runs] == [dg.DagsterRunStatus.SUCCESS], shard
        events = instance.fetch_materializations(
            dg.AssetRecordsFilter(
                asset_key=dg.AssetKey("ticket_routing"), asset_partitions=[stopped_shard]
            ),
            limit=1,
        ).records
        metadata = events[0].asset_materialization.metadata  # type: ignore[union-attr]
        assert events[0].run_id == retry.run_id
        resumed, computed = metadata["rows_resumed"].value, metadata["rows_computed"].value
        assert resumed > 0, metadata
        assert resumed + computed == metadata["rows_total"].value

        # Every run was a Ray job, which reserved the backfill's per-run resources (Ray holds
        # a job's entrypoint resources on its supervisor actor).
        from ray.util.state import list_actors

        jobs = {j.submission_id: j for j in ray.list_jobs()}
        reserved = {
            (a.name or "").removeprefix("_ray_internal_job_actor_"): a.required_resources
            for a in list_actors(
                address=ray_address,
                filters=[("class_name", "=", "JobSupervisor")],
                detail=True,
                limit=1000,
            )
        }
        for run in runs:
            job_id = f"dagster-run-{run.run_id}"
            expected = JobStatus.STOPPED if run.run_id == stopped.run_id else JobStatus.SUCCEEDED
            assert jobs[job_id].status == expected, jobs[job_id]
            assert (reserved[job_id] or {}).get("CPU") == RAY_TAG["num_cpus"], reserved

        # Downstream reads every shard back from S3.
        _dagster(env, "asset", "materialize", "-m", MODULE, "--select", "routing_summary")
        summary = subprocess.run(
            [
                sys.executable,
                "-c",
                "import dagster as dg\n"
                f"from {MODULE} import defs\n"
                "v = defs.load_asset_value('routing_summary', instance=dg.DagsterInstance.get())\n"
                "print(v['tickets'].sum())",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert summary.returncode == 0, summary.stderr[-3000:]
        assert int(summary.stdout.split()[-1]) == TICKETS

        durations = {
            r.tags["dagster/partition"] + ("(retry)" if r.parent_run_id else ""): round(
                (stats.end_time or 0) - (stats.launch_time or stats.start_time or 0), 1
            )
            for r in runs
            for stats in [instance.get_run_stats(r.run_id)]
        }
        print(
            f"\nbackfill done {backfill_seconds:.0f} s after start; run seconds (launch to end):"
            f" {durations}; resumed {resumed}, computed {computed} in {stopped_shard}"
        )
