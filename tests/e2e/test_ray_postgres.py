"""deploy/ray end to end on one machine: every shard of a UI backfill runs as a Ray job.

Real processes on 127.0.0.1: a PostgreSQL server holds the instance (runs, events), moto's S3
server holds the checkpoints and the compute logs, a local Ray head runs the runs (the launcher
of deploy/ray/dagster.yaml), and `dagster dev` (webserver, daemon) serves the demo with that
instance config. Ray starts in a temp dir with the package installed but not the demo: the demo
reaches each job through the launcher's runtime_env. Passwords and keys are in the cluster's
environment only. The backfill (2 shards on a cluster that runs 1 at once) is launched through
GraphQL as the UI launches it; one shard's Ray job is stopped half-way and the instance's run
retry resumes it from its checkpoint; before the backfill's runs, `dagster asset materialize`
runs a shard in process under the same daemon's run monitoring, which leaves it alone. Ray,
`dagster dev` and the in-process runs start side by side: the daemon picks a new backfill up only
every 30 s from its start.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml
from deploy_services import ROOT, dagster_dev, postgres_server, ray_head, unavailable
from helpers.graphql import launch_backfill

MODULE = "examples.ticket_routing.definitions"
SHARDS = [f"{i}-of-2" for i in range(2)]  # more than the cluster runs at once
TICKETS = 1000  # 500 rows a shard: 8 calls of 64 rows
LATENCY_MS = 1500  # per call: ~12 s of work a shard, a flush (every 5 s on S3) half-way
CLUSTER_CPUS = 1
RUN_SLOTS = 1  # runs the cluster holds at once: floor(1 CPU / num_cpus 1 of dagster.yaml)
MAX_RETRIES = 2  # run_retries.max_retries in deploy/ray/dagster.yaml
CLI_TAG = {"ops": {"ticket_routing": {"config": {"checkpoint_tag": "cli"}}}}


def _materialize(env: dict[str, str], log: Path, *args: str) -> Callable[[], None]:
    """Start `dagster asset materialize` of the demo (in process, as the docs run it), its
    output to ``log``; returns a function that waits for it to succeed."""
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dagster", "asset", "materialize", "-m", MODULE, *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def succeeded() -> None:
        try:
            assert process.wait(timeout=240) == 0, log.read_text()[-3000:]
        finally:
            process.kill()

    return succeeded


def _wait(what: str, check: Callable[[], Any], timeout: float, log: Path) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            print(f"{what}: {timeout - (deadline - time.monotonic()):.0f} s")
            return result
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out waiting for {what}; dagster dev log:\n" + log.read_text()[-4000:]
            )
        time.sleep(1)


def _instance_config(home: Path) -> dict[str, str]:
    """deploy/ray/dagster.yaml as it is, and the variables a platform team sets for this
    cluster: the demo's package as the code the jobs get, max_concurrent_runs sized as the
    file's comment says. Only the queue's poll interval is shorter (1 s, not Dagster's 5 s):
    the runs wait in the queue one after another."""
    config = yaml.safe_load((ROOT / "deploy" / "ray" / "dagster.yaml").read_text())
    launcher = config["run_launcher"]["config"]["ray"]
    assert CLUSTER_CPUS // launcher["num_cpus"] == RUN_SLOTS
    config["run_coordinator"]["config"]["dequeue_interval_seconds"] = 1
    (home / "dagster.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return {
        "DAGSTER_RAY_PY_MODULES": str(ROOT / "examples"),
        "DAGSTER_MAX_CONCURRENT_RUNS": str(RUN_SLOTS),
    }


def _installed_package_only(tmp_path: Path) -> str:
    """A PYTHONPATH holding this checkout's checkpoint_assets and nothing else: the cluster has
    the package installed (as in an image), not the repository."""
    site = tmp_path / "cluster_site"
    site.mkdir()
    (site / "checkpoint_assets").symlink_to(ROOT / "checkpoint_assets")
    return str(site)


@pytest.mark.slow
@pytest.mark.timeout(900)
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
        "DEMO_RUN_PER_SHARD": "1",  # one Ray job per shard: the stopped shard is one run
    }
    aws_keys = {  # moto takes any key; unique ones can be looked for in Ray's job list
        "AWS_ACCESS_KEY_ID": f"AKIA{secrets.token_hex(8).upper()}",
        "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
    }
    s3 = {
        "CHECKPOINT_BASE_DIR": base_dir,
        "DAGSTER_COMPUTE_LOG_BUCKET": bucket,
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    home = tmp_path / "dagster_home"
    home.mkdir()
    settings = _instance_config(home)
    log = tmp_path / "dagster_dev.log"

    started = time.monotonic()
    with postgres_server() as pg, ThreadPoolExecutor(1) as background:
        node_secrets = {"DAGSTER_PG_PASSWORD": pg["DAGSTER_PG_PASSWORD"], **aws_keys}
        # The Ray nodes hold the secrets and the demo's tuning, not the repository: the launcher
        # passes the instance's settings, the code comes through its runtime_env.
        passed_by_launcher = {*s3, *pg, *settings, "DAGSTER_HOME", "PYTHONPATH"}
        cluster_env = {k: v for k, v in os.environ.items() if k not in passed_by_launcher}
        cluster_env |= demo | node_secrets | {"PYTHONPATH": _installed_package_only(tmp_path)}
        env = {**os.environ, **demo, **s3, **pg, **aws_keys, **settings, "DAGSTER_HOME": str(home)}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        instance = dg.DagsterInstance.get()
        # The schema exists (the instance above made it) before other processes open it. The
        # in-process runs need no Ray: `tickets` runs while the Ray head and `dagster dev` start.
        tickets = _materialize(env, tmp_path / "tickets.log", "--select", "tickets")
        with ray_head(cluster_env, num_cpus=CLUSTER_CPUS) as head:
            env["RAY_ADDRESS"] = head.address
            monkeypatch.setenv("RAY_ADDRESS", head.address)

            def shard_in_process() -> Callable[[], None]:
                """A shard in process (to its own checkpoint tag: the backfill holds the default
                one), started once Ray answers and `tickets` is done, while `dagster dev` starts:
                it runs under the daemon's run monitoring, and holds the one run slot before the
                backfill's runs. Its calls take as long as the backfill's (~12 s of work), so
                run monitoring (every 5 s, once `dagster dev` is up) checks it while it runs."""
                head.wait()
                tickets()
                return _materialize(
                    env,
                    tmp_path / "cli.log",
                    *("--select", "ticket_routing", "--partition", SHARDS[0]),
                    *("--config-json", json.dumps(CLI_TAG)),
                )

            cli_started = background.submit(shard_in_process)
            with dagster_dev(env, log) as port:
                cli = cli_started.result()
                ray = JobSubmissionClient(head.address)
                backfill_id = launch_backfill(port, SHARDS, "ticket_routing")
                watch = _Watch(instance, backfill_id, ray, endpoint, bucket)
                stopped = _wait("a shard with a flushed part", watch.shard_half_done, 180, log)
                assert ray.stop_job(f"dagster-run-{stopped.run_id}")
                runs = _wait("every shard to succeed", watch.every_shard_done, 300, log)
                cli()
            backfill_seconds = time.monotonic() - started
            listing = str(ray.list_jobs())  # what `ray job list` prints
            reserved = _reserved_cpus(head.address)
            jobs = {j.submission_id: j for j in ray.list_jobs()}
            # The same instance config with 2 runs at once, more than the cluster holds.
            monkeypatch.setenv("DAGSTER_MAX_CONCURRENT_RUNS", str(RUN_SLOTS + 1))
            with dg.DagsterInstance.from_config(str(home)) as oversized:
                launcher = oversized.run_launcher
                warning = launcher._capacity_warning(runs[0])  # type: ignore[attr-defined]

        # Passwords and keys reached the runs from the nodes, never through a job's spec.
        assert "DAGSTER_PG_HOST" in listing  # the listing shows each job's env_vars
        for name, value in node_secrets.items():
            assert value not in listing, f"{name} is readable in the job list"

        # The stopped shard failed, and the instance's run retry (a new run, same backfill)
        # resumed the rows its checkpoint held; no other run failed (none by the start timeout:
        # runs beyond the cluster's 1 waited in Dagster's queue, never in Ray's).
        stopped_shard = stopped.tags["dagster/partition"]
        by_shard = {s: [r for r in runs if r.tags["dagster/partition"] == s] for s in SHARDS}
        assert instance.get_run_by_id(stopped.run_id).status == dg.DagsterRunStatus.FAILURE
        retry = next(r for r in by_shard[stopped_shard] if r.status == dg.DagsterRunStatus.SUCCESS)
        assert retry.tags.get("dagster/parent_run_id") == stopped.run_id
        for shard, shard_runs in by_shard.items():
            if shard != stopped_shard:
                assert [r.status for r in shard_runs] == [dg.DagsterRunStatus.SUCCESS], shard
        assert watch.peak_launched <= RUN_SLOTS < len(SHARDS), watch.peak_launched
        assert watch.queued_seen, "no run waited in Dagster's queue"
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

        # The in-process run was left to its process by run monitoring, which checked it: it
        # succeeded, was never failed, and no retry of it was launched.
        (cli_run,) = [
            r
            for r in instance.get_runs(dg.RunsFilter(tags={"dagster/partition": SHARDS[0]}))
            if "dagster/backfill" not in r.tags and not r.parent_run_id
        ]
        assert f"Checking run {cli_run.run_id}" in log.read_text(), "monitoring never saw it"
        assert cli_run.status == dg.DagsterRunStatus.SUCCESS
        assert not instance.all_logs(cli_run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)
        assert not instance.get_runs(dg.RunsFilter(tags={"dagster/parent_run_id": cli_run.run_id}))

        # Every run was a Ray job with the code from its runtime_env, which reserved the
        # launcher's num_cpus (Ray holds a job's entrypoint resources on its supervisor actor).
        for run in runs:
            job_id = f"dagster-run-{run.run_id}"
            expected = JobStatus.STOPPED if run.run_id == stopped.run_id else JobStatus.SUCCEEDED
            assert jobs[job_id].status == expected, jobs[job_id]
            assert (jobs[job_id].runtime_env or {}).get("py_modules"), jobs[job_id]
            assert reserved[job_id] == 1, reserved

        # Each launch was checked against the cluster: sized to it, no run was warned; with
        # max_concurrent_runs 2 a run would be (the cluster holds one at once).
        for run in runs:
            engine = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)
            assert not [e for e in engine if "max_concurrent_runs" in (e.message or "")]
        assert warning and "runs at most 1 at once" in warning, warning
        assert "Set max_concurrent_runs to 1" in warning, warning

        # Each finished run's compute logs are on S3, uploaded from the Ray node (the stopped
        # run was killed before its first upload).
        logs = _s3_keys(endpoint, bucket, "dagster/compute-logs/")
        for run in runs:
            if run.status == dg.DagsterRunStatus.SUCCESS:
                assert any(run.run_id in key for key in logs), (run.run_id, logs[:20])

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


def _s3_keys(endpoint: str, bucket: str, prefix: str) -> list[str]:
    import boto3

    pages = (
        boto3.client("s3", endpoint_url=endpoint)
        .get_paginator("list_objects_v2")
        .paginate(Bucket=bucket, Prefix=prefix)
    )
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _reserved_cpus(ray_address: str) -> dict[str, float | None]:
    """The CPUs each Ray job reserved, by submission id."""
    from ray.util.state import list_actors

    return {
        (a.name or "").removeprefix("_ray_internal_job_actor_"): (a.required_resources or {}).get(
            "CPU"
        )
        for a in list_actors(
            address=ray_address,
            filters=[("class_name", "=", "JobSupervisor")],
            detail=True,
            limit=1000,
        )
    }


class _Watch:
    """The backfill's runs as the test polls them: the peak of runs launched at once (STARTING
    or STARTED, which Ray holds), and whether any run waited QUEUED in Dagster."""

    def __init__(
        self, instance: dg.DagsterInstance, backfill_id: str, ray: Any, endpoint: str, bucket: str
    ) -> None:
        self.instance, self.ray, self.endpoint, self.bucket = instance, ray, endpoint, bucket
        self.filter = dg.RunsFilter(tags={"dagster/backfill": backfill_id})
        self.peak_launched = 0
        self.queued_seen = False

    def runs(self) -> list[dg.DagsterRun]:
        runs = self.instance.get_runs(self.filter)
        launched = {dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED}
        self.peak_launched = max(self.peak_launched, sum(r.status in launched for r in runs))
        self.queued_seen |= any(r.status == dg.DagsterRunStatus.QUEUED for r in runs)
        return runs

    def shard_half_done(self) -> dg.DagsterRun | None:
        """A started run whose shard has flushed a part to S3 but not finished."""
        keys = _s3_keys(self.endpoint, self.bucket, "checkpoints/ticket_routing/default/")
        for run in self.runs():
            shard = run.tags["dagster/partition"]
            if (
                run.status == dg.DagsterRunStatus.STARTED
                and any(f"/{shard}.parquet.parts/" in k for k in keys)
                and not any(k.endswith(f"/{shard}.parquet") for k in keys)
            ):
                return run
        return None

    def every_shard_done(self) -> list[dg.DagsterRun] | None:
        runs = self.runs()
        succeeded = {
            r.tags["dagster/partition"] for r in runs if r.status == dg.DagsterRunStatus.SUCCESS
        }
        for shard in set(SHARDS) - succeeded:
            failed = [
                r
                for r in runs
                if r.tags["dagster/partition"] == shard and r.status == dg.DagsterRunStatus.FAILURE
            ]
            if len(failed) > MAX_RETRIES:  # the instance gave up on this shard
                errors = [
                    e.message
                    for e in self.instance.all_logs(
                        failed[0].run_id, of_type=dg.DagsterEventType.RUN_FAILURE
                    )
                ]
                logs = self.ray.get_job_logs(f"dagster-run-{failed[0].run_id}")
                pytest.fail(
                    f"shard {shard} failed {len(failed)} times: {errors}\n"
                    f"Ray job log:\n{logs[-3000:]}"
                )
        done = succeeded == set(SHARDS) and all(r.is_finished for r in runs)
        return runs if done else None
