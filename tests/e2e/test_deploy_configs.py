"""The configurations in deploy/ load with the schemas of the Dagster packages they name.

What can be checked without a cluster: each instance config (deploy/ray/dagster.yaml, the
deploy/ecs/dagster.yaml, and the one Dagster's Helm chart renders from
deploy/kubernetes/values.yaml) passes Dagster's own instance validation, every configurable
class in it (run launcher, run coordinator, storage) accepts its config with that class's own
schema, and SQLAlchemy loads the Postgres driver the storage URL names. Helm itself is not
installed here (no Python or Debian package): the chart's rendering of the few values used is
mirrored below, and the Kubernetes parts are checked with dagster-k8s's models. Each config's
compute log manager is also built as configured and used: a step's stdout/stderr go to a moto
S3 server on 127.0.0.1 (reached through AWS_ENDPOINT_URL) under the configured bucket and prefix.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster._config import process_config
from dagster._core.instance.config import dagster_instance_config
from dagster._core.instance.ref import InstanceRef
from dagster._serdes import ConfigurableClassData
from deploy_services import ROOT, unavailable

DEPLOY = ROOT / "deploy"
# Every variable the configs read, so env-sourced fields resolve as they would in production.
ENV = {
    "RAY_ADDRESS": "http://ray-head:8265",
    "DAGSTER_RAY_PY_MODULES": "s3://code-bucket/code/my_project.zip",
    "DAGSTER_MAX_CONCURRENT_RUNS": "6",
    "DAGSTER_PG_HOST": "postgres.internal",
    "DAGSTER_PG_PORT": "5432",
    "DAGSTER_PG_USER": "dagster",
    "DAGSTER_PG_PASSWORD": "secret",
    "DAGSTER_PG_DB": "dagster",
    "DAGSTER_COMPUTE_LOG_BUCKET": "logs-bucket",
}


def _require(module: str, extra: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        unavailable(f'{module} is not installed (pip install -e ".[{extra}]")')


def _load_instance(text: str, home: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Validate an instance config as Dagster does when it starts, and each configurable class in
    it with its own schema (what instantiating it would check, without connecting anywhere).
    Returns the validated config."""
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    home.mkdir()
    (home / "dagster.yaml").write_text(text)
    config, _ = dagster_instance_config(str(home))
    ref = InstanceRef.from_dir(str(home))
    classes = [
        ref.run_launcher_data,
        ref.run_coordinator_data,
        ref.storage_data,
        ref.compute_logs_data,
        ref.local_artifact_storage_data,
    ]
    for data in classes:
        assert isinstance(data, ConfigurableClassData)
        klass = getattr(importlib.import_module(data.module_name), data.class_name)
        result = process_config(klass.config_type(), yaml.safe_load(data.config_yaml) or {})
        assert result.success, f"{data.class_name}: {[e.message for e in result.errors or []]}"
    return config


def _postgres_url_loads_its_driver(storage: dict[str, Any]) -> str:
    import sqlalchemy
    from dagster_postgres.utils import pg_url_from_config

    db = {k: v for k, v in storage["postgres"]["postgres_db"].items()}
    db = {k: ENV[v["env"]] if isinstance(v, dict) else v for k, v in db.items()}
    url = pg_url_from_config({"postgres_db": db})
    # create_engine imports the DBAPI the URL names, without connecting.
    sqlalchemy.create_engine(url)
    return url


def test_ray_instance_config_runs_every_run_as_a_ray_job_with_postgres_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _require("dagster_ray", "ray")
    _require("dagster_postgres", "postgres")
    config = _load_instance(
        (DEPLOY / "ray" / "dagster.yaml").read_text(), tmp_path / "home", monkeypatch
    )

    assert config["run_launcher"]["module"] == "checkpoint_assets.integration.deploy.ray_launcher"
    assert config["run_coordinator"]["class"] == "QueuedRunCoordinator"
    assert config["run_monitoring"]["enabled"] and config["run_retries"]["enabled"]
    assert config["concurrency"]["default_op_concurrency_limit"] > 0
    # Each Ray job gets the settings a run needs to reach the instance and the checkpoints, but
    # no password or key: a job's env_vars are plain text in `ray job list`.
    ray = config["run_launcher"]["config"]["ray"]
    passed = set(ray["env_vars"])
    assert {"DAGSTER_PG_HOST", "DAGSTER_PG_PORT", "DAGSTER_PG_DB", "CHECKPOINT_BASE_DIR"} <= passed
    assert not passed & {"DAGSTER_PG_PASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    # The run worker loads this config on the node: every variable it reads reaches the job,
    # but the password, which the nodes hold (the launcher's own settings: the daemon only).
    text = (DEPLOY / "ray" / "dagster.yaml").read_text()
    read = set(re.findall(r"^\s*(?:- )?env: (\w+)$", text, re.M))
    launcher = {"RAY_ADDRESS", "DAGSTER_RAY_PY_MODULES"}
    assert read - passed == {"DAGSTER_PG_PASSWORD", *launcher}, read - passed
    assert config["compute_logs"]["class"] == "S3ComputeLogManager"
    assert _postgres_url_loads_its_driver(config["storage"]).startswith("postgresql+psycopg2://")


def _ray_instance(home: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> Any:
    """The instance deploy/ray/dagster.yaml gives with ENV, then ``env``, in the environment;
    its storage on SQLite in ``home`` (no Postgres server needed for the launcher and queue)."""
    import dagster as dg

    for key, value in {**ENV, **env}.items():
        monkeypatch.setenv(key, value)
    home.mkdir()
    config = yaml.safe_load((DEPLOY / "ray" / "dagster.yaml").read_text())
    config["storage"] = {"sqlite": {"base_dir": str(home / "storage")}}
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    return dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))


def test_ray_instance_takes_its_code_and_run_concurrency_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _require("dagster_ray", "ray")
    _require("dagster_postgres", "postgres")
    instance = _ray_instance(tmp_path / "home", monkeypatch)
    launcher = instance.run_launcher
    assert launcher.runtime_env == {"py_modules": [ENV["DAGSTER_RAY_PY_MODULES"]]}
    assert launcher.address == ENV["RAY_ADDRESS"]
    queue = instance.get_concurrency_config().run_queue_config
    assert queue.max_concurrent_runs == int(ENV["DAGSTER_MAX_CONCURRENT_RUNS"])
    assert instance.get_concurrency_config().pool_config.default_pool_limit == 4


def test_ray_instance_with_empty_py_modules_uploads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image's default: the code is installed on the nodes, no job carries a runtime_env."""
    _require("dagster_ray", "ray")
    _require("dagster_postgres", "postgres")
    instance = _ray_instance(tmp_path / "home", monkeypatch, DAGSTER_RAY_PY_MODULES="")
    assert instance.run_launcher.runtime_env is None


@pytest.mark.parametrize("missing", ["DAGSTER_RAY_PY_MODULES", "DAGSTER_MAX_CONCURRENT_RUNS"])
def test_ray_instance_without_a_setting_names_the_variable(
    missing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _require("dagster_ray", "ray")
    _require("dagster_postgres", "postgres")
    from dagster._core.errors import DagsterInvalidConfigError

    instance = _ray_instance(tmp_path / "home", monkeypatch)
    monkeypatch.delenv(missing)
    with pytest.raises(DagsterInvalidConfigError, match=f'environment variable "{missing}"'):
        instance.run_launcher  # noqa: B018 - built on first use
        instance.get_concurrency_config()


def test_ecs_instance_config_is_a_valid_ecs_run_launcher_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _require("dagster_postgres", "postgres")
    text = (DEPLOY / "ecs" / "dagster.yaml").read_text()
    config = _load_instance(text, tmp_path / "home", monkeypatch)

    assert config["run_launcher"]["class"] == "EcsRunLauncher"
    # The run task definition is set: the launcher never has to determine an image itself.
    assert config["run_launcher"]["config"]["task_definition"]
    assert config["compute_logs"]["class"] == "S3ComputeLogManager"
    assert config["run_monitoring"]["enabled"] and config["run_retries"]["enabled"]
    assert _postgres_url_loads_its_driver(config["storage"]).startswith("postgresql+psycopg2://")


def _chart_instance_yaml(values: dict[str, Any]) -> str:
    """The dagster.yaml Dagster's Helm chart renders from these values (its instance ConfigMap),
    for the keys deploy/kubernetes/values.yaml sets."""
    pg = values["postgresql"]
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    daemon = values["dagsterDaemon"]
    monitoring, retries = daemon["runMonitoring"], daemon["runRetries"]
    concurrency = values["concurrency"]
    s3_logs = values["computeLogManager"]["config"]["s3ComputeLogManager"]
    instance = {
        "run_launcher": {
            "module": "dagster_k8s",
            "class": "K8sRunLauncher",
            "config": {
                "load_incluster_config": True,
                "job_namespace": "dagster",
                "image_pull_policy": "Always",
                "service_account_name": "dagster",
                "dagster_home": "/opt/dagster/dagster_home",
                "instance_config_map": "dagster-instance",
                "postgres_password_secret": values["global"]["postgresqlSecretName"],
                "env_secrets": [s["name"] for s in launcher["envSecrets"]],
                "fail_pod_on_run_failure": launcher["failPodOnRunFailure"],
                "run_k8s_config": {
                    "container_config": launcher["runK8sConfig"]["containerConfig"],
                },
            },
        },
        "run_coordinator": {
            "module": "dagster.core.run_coordinator",
            "class": "QueuedRunCoordinator",
            "config": daemon["runCoordinator"]["config"]["queuedRunCoordinator"],
        },
        "concurrency": {
            "runs": {"max_concurrent_runs": concurrency["runs"]["maxConcurrentRuns"]},
            "pools": {"default_limit": concurrency["pools"]["defaultLimit"]},
        },
        "run_monitoring": {
            "enabled": monitoring["enabled"],
            "poll_interval_seconds": monitoring["pollIntervalSeconds"],
            "start_timeout_seconds": monitoring["startTimeoutSeconds"],
            "max_resume_run_attempts": monitoring["maxResumeRunAttempts"],
        },
        "run_retries": {"enabled": retries["enabled"], "max_retries": retries["maxRetries"]},
        "storage": {
            "postgres": {
                "postgres_db": {
                    "username": pg["postgresqlUsername"],
                    "password": {"env": "DAGSTER_PG_PASSWORD"},
                    "hostname": pg["postgresqlHost"],
                    "db_name": pg["postgresqlDatabase"],
                    "port": pg["service"]["port"],
                    "scheme": pg["postgresqlScheme"],
                }
            }
        },
        "compute_logs": {
            "module": "dagster_aws.s3.compute_log_manager",
            "class": "S3ComputeLogManager",
            "config": {
                "bucket": s3_logs["bucket"],
                "prefix": s3_logs["prefix"],
                "region": s3_logs["region"],
            },
        },
        "telemetry": {"enabled": values["telemetry"]["enabled"]},
    }
    return yaml.safe_dump(instance)


def test_kubernetes_values_give_a_valid_k8s_run_launcher_instance_and_pod_resources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _require("dagster_k8s", "k8s")
    _require("dagster_postgres", "postgres")
    import kubernetes.client
    from dagster_k8s.models import k8s_model_from_dict

    values = yaml.safe_load((DEPLOY / "kubernetes" / "values.yaml").read_text())
    config = _load_instance(_chart_instance_yaml(values), tmp_path / "home", monkeypatch)
    assert config["run_launcher"]["class"] == "K8sRunLauncher"
    assert config["compute_logs"]["class"] == "S3ComputeLogManager"
    assert _postgres_url_loads_its_driver(config["storage"]).startswith("postgresql+psycopg2://")

    # The run pod's container config is a valid Kubernetes container (keys and quantities).
    container = values["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]
    model = k8s_model_from_dict(
        kubernetes.client.V1Container, {"name": "run", **container["containerConfig"]}
    )
    assert model.resources.requests["cpu"] == "500m"
    assert model.security_context.run_as_non_root

    # The code location's module exists, and the env it sets is what the definitions read.
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    args = deployment["dagsterApiGrpcArgs"]
    module = args[args.index("--module-name") + 1]
    assert importlib.util.find_spec(module) is not None, module
    assert {e["name"] for e in deployment["env"]} >= {"CHECKPOINT_BASE_DIR"}
    assert "CHECKPOINT_BASE_DIR" in (ROOT / Path(*module.split("."))).with_suffix(".py").read_text()
    # The image installs what run pods need to load the instance and the launcher.
    dockerfile = (DEPLOY / "kubernetes" / "Dockerfile").read_text()
    assert re.search(r'pip install .*"[^"]*\[[^\]]*k8s[^\]]*postgres[^\]]*\]"', dockerfile)


# Where each deployment's compute logs must land: the bucket the docs tell the operator to set
# (Ray: DAGSTER_COMPUTE_LOG_BUCKET), and the bucket and prefix the ECS run role may write
# (deploy/ecs/iam/data-task-role.json) and the Helm deployment's checkpoints are in.
COMPUTE_LOGS = {
    "ray": (ENV["DAGSTER_COMPUTE_LOG_BUCKET"], "dagster/compute-logs"),
    "kubernetes": ("my-bucket", "dagster/compute-logs"),
    "ecs": ("my-bucket", "dagster/compute-logs"),
}


def _compute_logs_section(deployment: str) -> dict[str, Any]:
    """The compute_logs section of a deployment's instance config, exactly as deployed."""
    if deployment == "kubernetes":
        values = yaml.safe_load((DEPLOY / "kubernetes" / "values.yaml").read_text())
        instance = yaml.safe_load(_chart_instance_yaml(values))
    else:
        instance = yaml.safe_load((DEPLOY / deployment / "dagster.yaml").read_text())
    section: dict[str, Any] = instance["compute_logs"]
    return section


@pytest.fixture
def compute_log_bucket(moto_s3: Any, deployment: str) -> Iterator[Any]:
    """The deployment's expected log bucket, created on the moto server and removed after."""
    import boto3

    bucket, _ = COMPUTE_LOGS[deployment]
    s3 = boto3.resource("s3", endpoint_url=moto_s3.endpoint, region_name="us-east-1")
    # Moto's buckets are process-wide and the Helm and ECS configs name the same one: each test
    # creates it and removes it.
    s3.Bucket(bucket).create()
    try:
        yield s3.Bucket(bucket)
    finally:
        s3.Bucket(bucket).objects.all().delete()
        s3.Bucket(bucket).delete()


@pytest.mark.parametrize("deployment", list(COMPUTE_LOGS))
def test_deployed_compute_log_manager_stores_a_steps_output_on_s3_and_reads_it_back(
    deployment: str,
    compute_log_bucket: Any,
    moto_s3: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run's stdout/stderr, captured by the deployment's own compute_logs section, is on S3
    under the configured bucket and prefix, and the manager reads it back once the node that
    ran the step is gone (its staged copy deleted). The endpoint comes from AWS_ENDPOINT_URL,
    which boto3 reads as the Ray docs say; the configs themselves are unchanged."""
    import dagster as dg

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint)
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        yaml.safe_dump({"compute_logs": _compute_logs_section(deployment)})
    )

    @dg.asset
    def noisy() -> None:
        print(f"rows done on {deployment}")
        print(f"a warning on {deployment}", file=sys.stderr)

    with dg.DagsterInstance.from_config(str(home)) as instance:
        result = dg.materialize([noisy], instance=instance)
        assert result.success
        (captured,) = [
            e.event_specific_data
            for e in result.all_events
            if e.event_type == dg.DagsterEventType.LOGS_CAPTURED
        ]
        manager = instance.compute_log_manager
        log_key = manager.build_log_key_for_run(result.run_id, captured.file_key)

        _, prefix = COMPUTE_LOGS[deployment]
        keys = {o.key for o in compute_log_bucket.objects.filter(Prefix=f"{prefix}/")}
        stored = "/".join([prefix, "storage", *log_key])
        assert {f"{stored}.out", f"{stored}.err"} <= keys, (
            f"not under s3://{compute_log_bucket.name}/{prefix}/"
        )

        manager.local_manager.delete_logs(log_key=log_key)  # the run's node is gone
        data = manager.get_log_data(log_key)
        assert f"rows done on {deployment}" in data.stdout.decode()
        assert f"a warning on {deployment}" in data.stderr.decode()
