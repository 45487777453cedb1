"""deploy/ecs is a complete ECS deployment that holds together, checked without AWS.

The task definitions and services are valid input of ECS's own API (botocore's service model);
the workspace reaches the code server that its task definition runs; secrets reach the tasks
only as references to Secrets Manager or SSM; and the IAM policies allow every ECS call that
dagster-aws' EcsRunLauncher makes, read from its source, so a release that adds one fails here.
(The instance config, deploy/ecs/dagster.yaml, is checked with Dagster's schemas in
test_deploy_configs.py.)
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import botocore.session
import pytest
import yaml
from botocore.validate import ParamValidator
from deploy_services import ROOT

ECS = ROOT / "deploy" / "ecs"
ROLES = ("webserver", "daemon", "code-server", "run")
SECRET_WORDS = re.compile(r"PASSWORD|SECRET|TOKEN|API_KEY|ACCESS_KEY|CREDENTIAL", re.IGNORECASE)
REFERENCE = re.compile(r"arn:aws:(secretsmanager:[^:]+:\d+:secret:|ssm:[^:]+:\d+:parameter/)\S+")


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _task(role: str) -> dict[str, Any]:
    task: dict[str, Any] = _json(ECS / "task-definitions" / f"{role}.json")
    return task


def _container(role: str) -> dict[str, Any]:
    (container,) = _task(role)["containerDefinitions"]
    return container


def _service(family: str) -> dict[str, Any]:
    (service,) = [s for s in _json(ECS / "services.json") if s["taskDefinition"] == family]
    return service


def _policy_actions(name: str) -> dict[str, list[str]]:
    """action -> the resources allowing it, in deploy/ecs/iam/NAME.json."""
    allowed: dict[str, list[str]] = {}
    for statement in _json(ECS / "iam" / f"{name}.json")["Statement"]:
        assert statement["Effect"] == "Allow"
        resources = statement["Resource"]
        for action in statement["Action"]:
            allowed.setdefault(action, []).extend(
                [resources] if isinstance(resources, str) else resources
            )
    return allowed


def _ecs_api() -> Any:
    return botocore.session.get_session().get_service_model("ecs")


@pytest.mark.parametrize("role", ROLES)
def test_task_definitions_are_valid_register_task_definition_input(role: str) -> None:
    shape = _ecs_api().operation_model("RegisterTaskDefinition").input_shape
    report = ParamValidator().validate(_task(role), shape)
    assert not report.has_errors(), report.generate_report()


def test_services_are_valid_create_service_input_with_a_single_daemon() -> None:
    shape = _ecs_api().operation_model("CreateService").input_shape
    for service in _json(ECS / "services.json"):
        report = ParamValidator().validate(service, shape)
        assert not report.has_errors(), report.generate_report()
    # Two daemons would both dequeue and launch runs: one task, never two during a deployment.
    daemon = _service(_task("daemon")["family"])
    assert daemon["desiredCount"] == 1
    assert daemon["deploymentConfiguration"]["maximumPercent"] == 100


def test_workspace_points_at_the_code_server_its_task_definition_runs() -> None:
    (location,) = yaml.safe_load((ECS / "workspace.yaml").read_text())["load_from"]
    server = location["grpc_server"]
    code = _container("code-server")
    command = code["command"]
    assert command[:3] == ["dagster", "api", "grpc"]
    assert int(command[command.index("--port") + 1]) == server["port"]
    (port,) = code["portMappings"]
    assert port["containerPort"] == server["port"]
    # The name the webserver and daemon resolve is the code server service's Service Connect alias.
    (connect,) = _service(_task("code-server")["family"])["serviceConnectConfiguration"]["services"]
    assert connect["portName"] == port["name"]
    assert {"dnsName": server["host"], "port": server["port"]} in connect["clientAliases"]
    for role in ("webserver", "daemon"):
        client = _service(_task(role)["family"])["serviceConnectConfiguration"]
        assert client["enabled"] and client["namespace"] == "dagster.local"
        assert "/workspace.yaml" in " ".join(_container(role)["command"])
    module = command[command.index("--module-name") + 1]
    assert importlib.util.find_spec(module) is not None, module


def test_every_task_runs_the_one_image_and_the_run_launcher_uses_the_run_task() -> None:
    images = {_container(role)["image"] for role in ROLES}
    assert len(images) == 1
    env = {e["name"]: e["value"] for e in _container("code-server")["environment"]}
    assert env["DAGSTER_CURRENT_IMAGE"] in images
    launcher = yaml.safe_load((ECS / "dagster.yaml").read_text())["run_launcher"]["config"]
    # With the run task definition set, the launcher never needs to guess an image.
    assert launcher["task_definition"] == _task("run")["family"]
    assert launcher["container_name"] == _container("run")["name"]


@pytest.mark.parametrize("role", ROLES)
def test_secrets_reach_the_tasks_only_as_references(role: str) -> None:
    container = _container(role)
    plain = [e["name"] for e in container.get("environment", []) if SECRET_WORDS.search(e["name"])]
    assert not plain, f"{role} sets {plain} in plain text: move them to `secrets`"
    for secret in container.get("secrets", []):
        assert REFERENCE.fullmatch(secret["valueFrom"]), secret
    # Every variable the instance config reads is given to the task, one way or the other.
    given = {e["name"] for e in container.get("environment", []) + container.get("secrets", [])}
    read = set(re.findall(r"env: (\w+)", (ECS / "dagster.yaml").read_text()))
    assert read <= given, f"{role} lacks {read - given}"


def test_the_execution_role_can_read_every_secret_the_tasks_name() -> None:
    allowed = _policy_actions("execution-role")
    for role in ROLES:
        for secret in _container(role).get("secrets", []):
            arn = secret["valueFrom"]
            if ":secretsmanager:" in arn:
                # The secret's full ARN: its name, then the suffix Secrets Manager adds.
                full = ":".join(arn.split(":")[:7]) + "-AbCdEf"
                resources = allowed["secretsmanager:GetSecretValue"]
            else:
                full, resources = arn, allowed["ssm:GetParameters"]
            assert any(fnmatch.fnmatchcase(full, r) for r in resources), arn


def _launcher_source() -> str:
    import dagster_aws.ecs.launcher

    folder = Path(dagster_aws.ecs.launcher.__file__).parent
    return "".join((folder / f).read_text() for f in ("launcher.py", "tasks.py", "utils.py"))


def _ecs_calls(source: str) -> set[str]:
    """The ECS API actions behind every call on an ECS client in the launcher's code."""
    calls = set(re.findall(r"\b(?:self\.)?ecs\.([a-z_]+)\(", source))
    return {"ecs:" + "".join(word.title() for word in call.split("_")) for call in calls}


def test_the_daemon_role_allows_every_call_the_ecs_run_launcher_makes() -> None:
    source = _launcher_source()
    calls = _ecs_calls(source)
    assert {"ecs:RunTask", "ecs:DescribeTasks", "ecs:StopTask"} <= calls  # the grep still works
    allowed = _policy_actions("daemon-task-role")
    assert calls <= allowed.keys(), f"the daemon's role lacks {calls - allowed.keys()}"
    # Beyond ECS: tags at launch, its own task's network interfaces, logs of a failed task.
    if '"tags"' in source:
        assert "ecs:TagResource" in allowed
    if "ec2.NetworkInterface(" in source:
        assert "ec2:DescribeNetworkInterfaces" in allowed
    if "get_log_events(" in source:
        assert "logs:GetLogEvents" in allowed
    # Secrets looked up by tag would need ListSecrets and GetSecretValue: the config names none.
    launcher = yaml.safe_load((ECS / "dagster.yaml").read_text())["run_launcher"]["config"]
    assert launcher.get("secrets_tag", "dagster") is None or "secretsmanager:ListSecrets" in allowed
    # ...and it hands the run task its roles.
    run = _task("run")
    assert {run["taskRoleArn"], run["executionRoleArn"]} <= set(allowed["iam:PassRole"])
    family = f":task-definition/{run['family']}:"
    assert any(family in r for r in allowed["ecs:RunTask"])


def test_the_webserver_role_can_terminate_runs() -> None:
    # Terminating from the UI builds the run launcher (it reads the run task definition), then
    # stops the run's task.
    needed = {"ecs:DescribeTaskDefinition", "ecs:DescribeTasks", "ecs:StopTask"}
    assert needed <= _policy_actions("webserver-task-role").keys()


def test_run_tasks_may_write_and_the_webserver_may_read_the_configured_compute_logs() -> None:
    # The key layout of dagster-aws' S3ComputeLogManager (checked against moto in
    # test_deploy_configs.py): PREFIX/storage/RUN_ID/compute_logs/FILE.out
    config = yaml.safe_load((ECS / "dagster.yaml").read_text())["compute_logs"]["config"]
    key = f"arn:aws:s3:::{config['bucket']}/{config['prefix']}/storage/run/compute_logs/step.out"
    assert _task("run")["taskRoleArn"].endswith("/checkpoint-assets-data")
    for role, action in (
        ("data-task-role", "s3:PutObject"),
        ("webserver-task-role", "s3:GetObject"),
    ):
        resources = _policy_actions(role).get(action, [])
        assert any(fnmatch.fnmatchcase(key, r) for r in resources), (role, action, key)


def test_the_grep_finds_calls_the_way_they_are_written() -> None:
    source = "self.ecs.run_task(**kw)\necs.describe_tasks(x)\nself.ecs.meta.region_name\n"
    assert _ecs_calls(source) == {"ecs:RunTask", "ecs:DescribeTasks"}
