"""CheckpointedAssetComponent: a checkpointed asset declared in a defs.yaml, the way a `dg`
project uses it. In process: the example project's definitions materialize a shard with its
checks (what `dg launch` runs there), and a scaffolded component materializes. In
subprocesses (slow): `dg list components` and `dg check defs` on a copy of
examples/dg_project, and a new `create-dagster` project taken through `dg scaffold defs`,
`dg check defs` (a sound component and a broken one) and `dg launch`."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import polars as pl
import pydantic
import pytest
from dagster.components.resolved.errors import ResolutionException
from dagster.components.testing import create_defs_folder_sandbox
from helpers.jobs import ids_in_shard

from checkpoint_assets import (
    Budget,
    CheckpointedAssetComponent,
    CheckpointError,
    CheckpointIOManager,
    Price,
    checkpointed_asset,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dg_project"
COMPONENT = "checkpoint_assets.CheckpointedAssetComponent"
CHECKS = ("completeness", "failed_rows")


@pytest.fixture
def example_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The example project importable, as `pip install -e examples/dg_project` makes it."""
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    yield
    for name in [m for m in sys.modules if m == "dg_project" or m.startswith("dg_project.")]:
        del sys.modules[name]


def test_example_project_materializes_a_shard_in_process(
    example_on_path: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))  # the project's CheckpointIOManager()
    defs = dg.load_from_defs_folder(project_root=EXAMPLE)
    routing = defs.resolve_assets_def("ticket_routing")
    tickets = defs.resolve_assets_def("tickets")
    assert routing.partitions_def is not None
    assert routing.partitions_def.get_partition_keys() == [f"{i}-of-4" for i in range(4)]
    assert routing.group_names_by_key[routing.key] == "support"
    assert isinstance(defs.resources["io_manager"], CheckpointIOManager)

    job = defs.resolve_implicit_global_asset_job_def()  # the shard's checks come with it
    result = job.execute_in_process(
        partition_key="2-of-4",
        asset_selection=[tickets.key, routing.key],
        instance=dg.DagsterInstance.ephemeral(),
    )

    assert result.success
    rows = pl.read_parquet(tmp_path / "checkpoints" / "tickets.parquet")
    expected = ids_in_shard(rows, 2, 4)
    stored = pl.read_parquet(tmp_path / "checkpoints" / "ticket_routing/default/2-of-4.parquet")
    assert sorted(stored["ticket_id"]) == sorted(expected)
    [event] = [
        e.materialization
        for e in result.get_asset_materialization_events()
        if e.materialization.asset_key == routing.key
    ]
    assert event.metadata["rows_computed"].value == len(expected)
    assert event.metadata["rows_failed"].value == 0
    evaluations = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert evaluations == dict.fromkeys(CHECKS, True)
    departments = dict(zip(stored["ticket_id"], stored["department"], strict=True))
    subjects = dict(zip(rows["ticket_id"], rows["subject"], strict=True))
    by_subject = {"Refund request": "billing", "App crash on start": "technical"}
    for ticket_id, department in departments.items():
        assert department == by_subject.get(subjects[ticket_id], department)
    assert {"billing", "technical"} <= set(departments.values())


def test_scaffolded_component_loads_its_batch_stub_and_materializes(tmp_path: Path) -> None:
    with create_defs_folder_sandbox() as sandbox:
        path = sandbox.scaffold_component(
            component_cls=CheckpointedAssetComponent,
            defs_path="scored",
            scaffold_params={"source": "tickets", "id_column": "ticket_id", "shards": 2},
        )
        text = (path / "defs.yaml").read_text()
        assert text.startswith("type: checkpoint_assets.") and "CheckpointedAssetComponent" in text
        for line in ("fn: .batch:process_batch", "source: tickets", "shards: 2", "name: scored"):
            assert f"\n  {line}\n" in text
        # Every other attribute is listed, commented out, with the decorator's default.
        assert "\n  # checkpoint_interval: 16\n" in text
        assert "\n  # failed_partitions_sensor: false\n" in text
        assert (path / "batch.py").exists()
        with pytest.raises(CheckpointError, match=r"scaffolds a defs\.yaml"):
            sandbox.scaffold_component(CheckpointedAssetComponent, scaffold_format="python")

        with sandbox.load_component_and_build_defs(defs_path=path) as (component, defs):
            assert isinstance(component, CheckpointedAssetComponent)
            assert not defs.resources  # the project binds the IO manager
            rows = pl.DataFrame({"ticket_id": range(40), "body": [f"b{i}" for i in range(40)]})
            defs = with_tickets(defs, rows, tmp_path)
            result = dg.materialize(
                [defs.resolve_assets_def("tickets"), defs.resolve_assets_def("scored")],
                partition_key="1-of-2",
                instance=dg.DagsterInstance.ephemeral(),
            )

    assert result.success
    stored = pl.read_parquet(tmp_path / "scored" / "default" / "1-of-2.parquet")
    assert sorted(stored["ticket_id"]) == sorted(ids_in_shard(rows, 1, 2))
    assert set(stored["output"]) == {"todo"}


def with_tickets(
    defs: dg.Definitions, rows: pl.DataFrame, base_dir: Path | None = None
) -> dg.Definitions:
    """``defs`` with the source asset its component reads, and the project's IO manager."""

    @dg.asset
    def tickets() -> pl.DataFrame:
        return rows

    resources = {"io_manager": CheckpointIOManager(base_dir=str(base_dir))} if base_dir else {}
    return dg.Definitions.merge(defs, dg.Definitions(assets=[tickets], resources=resources))


def _component(yaml: str) -> CheckpointedAssetComponent:
    base = "fn: helpers.jobs:route\nsource: tickets\nid_column: ticket_id\n"
    component = CheckpointedAssetComponent.resolve_from_yaml(base + yaml)
    assert isinstance(component, CheckpointedAssetComponent)
    return component


def _defs(yaml: str) -> dg.Definitions:
    """The component's own definitions (resolving them needs the source: ``_resolved``)."""
    return _component(yaml).build_defs(dg.ComponentTree.for_test().load_context)


def _resolved(defs: dg.Definitions, name: str) -> dg.AssetsDefinition:
    return with_tickets(defs, pl.DataFrame({"ticket_id": [1]})).resolve_assets_def(name)


def test_attributes_add_checks_sensor_global_resume_and_their_own_io_manager(
    tmp_path: Path,
) -> None:
    own = _defs(
        f"name: routed\nshards: 8\ncode_version: v2\nbase_dir: {tmp_path}\n"
        "io_manager_key: checkpoints\ncheckpoint_checks: true\nglobal_resume_asset: true\n"
        "failed_partitions_sensor: {max_retries: 5, backoff_seconds: 0, default_status: RUNNING}\n"
    )
    assert set(own.resources or {}) == {"checkpoints"}
    assert {key.name for c in own.asset_checks or [] for key in c.check_keys} == set(CHECKS)
    [sensor] = own.sensors or []
    assert sensor.name == "routed_failed_partitions"
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING

    rows = pl.DataFrame({"ticket_id": range(50), "body": [f"b{i}" for i in range(50)]})
    defs = with_tickets(own, rows)  # the project's io_manager stays Dagster's default
    routed = defs.resolve_assets_def("routed")
    assert routed.partitions_def is not None
    assert len(routed.partitions_def.get_partition_keys()) == 8
    assert routed.code_versions_by_key[routed.key] == "v2"
    global_resume = defs.resolve_assets_def("routed_global_resume")
    assert routed.key in global_resume.asset_deps[global_resume.key]
    result = dg.materialize(
        [defs.resolve_assets_def("tickets"), routed, *(own.asset_checks or [])],
        partition_key="3-of-8",
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    stored = pl.read_parquet(tmp_path / "routed" / "default" / "3-of-8.parquet")
    assert sorted(stored["ticket_id"]) == sorted(ids_in_shard(rows, 3, 8))
    assert all(e.passed for e in result.get_asset_check_evaluations())
    assert len(result.get_asset_check_evaluations()) == 2


def test_metadata_and_backfill_policy_reach_the_asset() -> None:
    routed = _resolved(
        _defs(
            "name: routed\nshards: 8\nmetadata: {owner: data-team, tier: 2}\n"
            "backfill_policy: {type: multi_run, max_partitions_per_run: 4}\n"
        ),
        "routed",
    )
    assert routed.backfill_policy == dg.BackfillPolicy.multi_run(4)
    metadata = routed.metadata_by_key[routed.key]
    assert (metadata["owner"], metadata["tier"]) == ("data-team", 2)
    assert metadata["checkpoint_assets/id_column"] == "ticket_id"  # the asset's own, beside them

    single = _resolved(
        _defs("name: routed\nshards: 2\nbackfill_policy: {type: single_run}\n"), "routed"
    )
    assert single.backfill_policy == dg.BackfillPolicy.single_run()
    with pytest.raises(pydantic.ValidationError, match="single_run"):
        _component("backfill_policy: {type: sometimes}\n")


def test_a_budget_in_yaml_is_the_decorators_budget() -> None:
    component = _component(
        "usage_columns: [prompt_tokens, completion_tokens]\n"
        "budget: {prices: {small: {input: 0.15, output: 0.6}}, input_tokens: prompt_tokens, "
        "output_tokens: completion_tokens, max_run_cost: 5}\n"
    )
    assert component.budget == Budget(
        {"small": Price(input=0.15, output=0.6)},
        input_tokens="prompt_tokens",
        output_tokens="completion_tokens",
        max_run_cost=5.0,
    )
    assert _defs(
        "usage_columns: [input_tokens, output_tokens]\n"
        "budget: {prices: {m: {input: 1, output: 1}}}\n"
    ).assets
    with pytest.raises(ValueError, match="add them to usage_columns"):
        _defs("budget: {prices: {small: {input: 1, output: 2}}}\n")


def test_without_flags_it_adds_the_asset_alone() -> None:
    bare = _defs("name: routed\n")
    assert not bare.sensors and not bare.asset_checks and not bare.resources
    assert [a.key for a in bare.assets or []] == [dg.AssetKey("routed")]
    assert _resolved(bare, "routed").partitions_def is None
    assert _defs("failed_partitions_sensor: true\n").sensors


def test_fn_reference_errors_say_what_to_write() -> None:
    cases = {
        "helpers.jobs.route": "fn must be 'module:function'",
        "helpers.no_such_module:route": "there is no module 'helpers.no_such_module'",
        "helpers.jobs:no_such_function": "has no attribute 'no_such_function'",
        "helpers.jobs:ASSET": "has a non-callable 'ASSET'",
    }
    for reference, message in cases.items():
        with pytest.raises(ResolutionException, match=re.escape(message)):
            CheckpointedAssetComponent.resolve_from_yaml(
                f"fn: {reference}\nsource: tickets\nid_column: ticket_id\n"
            )


def test_batch_size_is_passed_on_only_when_the_decorator_takes_it() -> None:
    if "batch_size" in inspect.signature(checkpointed_asset).parameters:
        assert _resolved(_defs("name: routed\nbatch_size: 4\n"), "routed")
    else:
        with pytest.raises(CheckpointError, match="batch_size is not supported"):
            _defs("batch_size: 4\n")


# --- the dg CLI, in subprocesses ---------------------------------------------------------------


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the example project, with its package importable and a fresh DAGSTER_HOME.
    The tests change nothing in it."""
    tmp = tmp_path_factory.mktemp("dg")
    copy = tmp / "dg_project"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    home = tmp / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    return copy


def dg_cli(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["DAGSTER_HOME"] = str(project.parent / "dagster_home")
    env["PYTHONPATH"] = os.pathsep.join([str(project / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "dagster_dg_cli.cli", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_dg_list_components_shows_it(project: Path) -> None:
    listed = dg_cli(project, "list", "components", "--json")
    assert listed.returncode == 0, listed.stderr[-3000:]
    keys = {item["key"]: item for item in json.loads(listed.stdout)["items"]}
    assert COMPONENT in keys
    assert "checkpointed" in keys[COMPONENT]["summary"]


@pytest.mark.slow
def test_dg_check_accepts_the_example(project: Path) -> None:
    # On a scaffolded component, sound and broken: the create-dagster project's test below.
    checked = dg_cli(project, "check", "defs")
    assert checked.returncode == 0, checked.stderr[-3000:]


@pytest.mark.slow
def test_a_new_create_dagster_project_reaches_dg_launch_as_the_readme_says(tmp_path: Path) -> None:
    created = subprocess.run(
        [sys.executable, "-c", "from create_dagster.cli import main; main()",
         "project", "my-project", "--no-uv-sync"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, DAGSTER_DG_UPDATE_CHECK_ENABLED="0"),  # no PyPI query
    )  # fmt: skip
    assert created.returncode == 0, created.stderr[-3000:]
    project = tmp_path / "my-project"
    assert '"dagster==1.13.27"' in (project / "pyproject.toml").read_text()  # what pip installs
    defs = project / "src" / "my_project" / "defs"
    for name in ("tickets.py", "resources.py"):  # copied from the example, as README says
        shutil.copy(EXAMPLE / "src" / "dg_project" / "defs" / name, defs / name)
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").touch()

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, DAGSTER_HOME=str(home))
        env["PYTHONPATH"] = os.pathsep.join([str(project / "src"), env.get("PYTHONPATH", "")])
        done = subprocess.run(
            [sys.executable, "-m", "dagster_dg_cli.cli", *args],
            cwd=project, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert (done.returncode == 0) == ok, done.stderr[-3000:]
        assert "No dagster instance configuration" not in done.stderr
        return done

    run("scaffold", "defs", COMPONENT, "ticket_routing",
        "--source", "tickets", "--id-column", "ticket_id", "--shards", "4")  # fmt: skip
    scaffolded = defs / "ticket_routing" / "defs.yaml"
    assert "source: tickets" in scaffolded.read_text()
    run("check", "defs")
    run("launch", "--assets", "tickets,ticket_routing", "--partition", "1-of-4")  # one run

    stored = pl.read_parquet(home / "checkpoints" / "ticket_routing" / "default" / "1-of-4.parquet")
    tickets = pl.read_parquet(home / "checkpoints" / "tickets.parquet")
    assert sorted(stored["ticket_id"]) == sorted(ids_in_shard(tickets, 1, 4))
    assert set(stored["output"]) == {"todo"}  # the scaffolded stub's answer

    # A reference to no module: `dg check defs` fails and names it.
    scaffolded.write_text(scaffolded.read_text().replace("fn: .batch:", "fn: .no_such_module:"))
    broken = run("check", "defs", ok=False)
    assert "there is no module 'my_project.defs.ticket_routing.no_such_module'" in (
        broken.stdout + broken.stderr
    )
