"""deploy/kubernetes/values.yaml passes the values schema of Dagster's Helm chart, as `helm
install` checks it: the user's values coalesced over the chart's defaults, then validated.

Helm is not installed here and CI has no network: no Debian, PyPI or npm package ships a Helm
binary for this Python (helm-sdkpy bundles Helm as a library, needs Python 3.12 and renders only
against a cluster), and the chart itself cannot be downloaded. So the chart's templates are not
rendered: its `values.schema.json` and default `values.yaml` are vendored in
tests/data/dagster-helm (README.md there names their commit). The chart's schema points at
Kubernetes' own object schemas by URL (resources, probes, security contexts); offline those
resolve to "any object", and tests/e2e/test_deploy_configs.py checks the Kubernetes objects the
values set with dagster-k8s's models instead.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import referencing
import referencing.exceptions
import referencing.jsonschema
import yaml
from deploy_services import ROOT

CHART = ROOT / "tests" / "data" / "dagster-helm"
VALUES = ROOT / "deploy" / "kubernetes" / "values.yaml"
KUBERNETES_SCHEMAS = "https://raw.githubusercontent.com/yannh/kubernetes-json-schema/"


def coalesce(defaults: Any, user: Any) -> Any:
    """Helm's merge of values over a chart's defaults: maps merge key by key, anything else (lists
    included) is replaced, and a user's null deletes the default."""
    if not (isinstance(defaults, dict) and isinstance(user, dict)):
        return user
    merged = dict(defaults)
    for key, value in user.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = coalesce(defaults.get(key), value)
    return merged


class _AnyObject(dict[str, Any]):
    """An empty schema (anything passes) at every JSON pointer into it."""

    def __getitem__(self, key: str) -> _AnyObject:
        return _AnyObject()


def _offline(uri: str) -> referencing.Resource[Any]:
    if not uri.startswith(KUBERNETES_SCHEMAS):
        raise referencing.exceptions.NoSuchResource(uri)
    return referencing.jsonschema.DRAFT202012.create_resource(_AnyObject())


def chart_errors(values: dict[str, Any]) -> list[str]:
    """What `helm install -f` with these values would refuse, one line per error."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    validator = jsonschema.Draft202012Validator(
        schema, registry=referencing.Registry(retrieve=_offline)
    )
    errors = validator.iter_errors(coalesce(defaults, values))
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors)


def _values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(VALUES.read_text())
    return values


def test_chart_defaults_alone_are_valid() -> None:
    # The vendored pair belongs together: the chart's own defaults pass its schema.
    assert chart_errors({}) == []


def test_kubernetes_values_pass_the_chart_schema_with_every_required_key() -> None:
    assert chart_errors(_values()) == []


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        (("runLauncher", "config", "k8sRunLauncher", "imagePullPolicy"), "Sometimes"),
        (("dagster-user-deployments", "deployments"), [{"name": "no-image", "port": 3030}]),
        (("dagsterDaemon", "runRetries", "maxRetries"), "two"),
        (("concurrency", "runs", "maxConcurrentRuns"), "16"),
    ],
)
def test_a_value_the_chart_refuses_is_reported(path: tuple[str, ...], bad: Any) -> None:
    values = _values()
    node = values
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = bad
    assert chart_errors(values), f"{'.'.join(path)}={bad!r} should fail the chart's schema"


def test_every_helm_command_pins_the_chart_to_the_images_dagster() -> None:
    """Without --version Helm installs the newest chart, whose instance config can need a newer
    Dagster than the image has. The chart's version is the Dagster release."""
    constraints = (ROOT / "deploy" / "kubernetes" / "constraints.txt").read_text()
    (dagster,) = re.findall(r"^dagster==(\S+)$", constraints, re.M)
    commands = [
        command
        for path in [ROOT / "docs" / "deploying.md", VALUES]
        for command in re.findall(r"helm (?:upgrade --install|install) .*", path.read_text())
    ]
    assert len(commands) >= 2, commands
    for command in commands:
        assert re.search(rf"--version {re.escape(dagster)}(\s|$)", command), command


def test_coalesce_merges_maps_replaces_lists_and_deletes_on_null() -> None:
    defaults = {"a": {"b": 1, "c": 2}, "l": [1, 2], "gone": 3}
    assert coalesce(defaults, {"a": {"b": 5}, "l": [9], "gone": None}) == {
        "a": {"b": 5, "c": 2},
        "l": [9],
    }
