"""The built wheel installs beside the Dagster a team already runs.

The wheel is built once (by uv). A fresh venv gets the newest or the oldest Dagster of the
package's range and the package's other requirements (installed by uv, which is faster); pip then
installs the wheel, as a user does, and resolves every requirement again. pip must change no
Dagster package (the versions are read with ``uv pip freeze``), the `dagster` CLI must
materialize a checkpointed asset and its source there in one run, and no output of it may warn of
a version mismatch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from helpers.venvs import venv_with
from packaging.requirements import Requirement
from uv import find_uv_bin

from checkpoint_assets.engine.checkpoints.layout import Files, checkpoint_name, output_name

ROOT = Path(__file__).resolve().parents[2]
# Two installs and a Dagster run in a fresh venv: past the default 300 s on a busy machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DEFS = """
import dagster as dg
import polars as pl

from checkpoint_assets import CheckpointIOManager, checkpointed_asset, shard_partitions


@dg.asset
def numbers() -> pl.DataFrame:
    return pl.DataFrame({"id": list(range(100)), "x": list(range(100))})


@checkpointed_asset(partitions_def=shard_partitions(2), id_column="id", source="numbers")
def doubled(batch: pl.DataFrame) -> pl.DataFrame:
    return batch.select("id", (pl.col("x") * 2).alias("y"))


defs = dg.Definitions(
    assets=[numbers, doubled],
    resources={"io_manager": CheckpointIOManager(base_dir=%r)},
)
"""


def _run(*cmd: str | Path, **kwargs: object) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs
    )
    assert done.returncode == 0, f"{cmd}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def _dagster_versions(python: Path) -> dict[str, str]:
    frozen = _run(find_uv_bin(), "pip", "freeze", "--python", python)
    pins = dict(line.split("==", 1) for line in frozen.splitlines() if "==" in line)
    return {name: v for name, v in pins.items() if name.lower().startswith("dagster")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's wheel, built once for both ends of the range (tests/conftest.py keeps this
    file's tests on one xdist worker)."""
    # Built from a copy: setuptools leaves a build/ folder beside the sources it builds.
    source = tmp_path_factory.mktemp("source")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "checkpoint_assets", source / "checkpoint_assets", ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    wheels = tmp_path_factory.mktemp("wheels")
    _run(find_uv_bin(), "build", "-q", "--wheel", "-o", wheels, source)
    (built,) = wheels.glob("checkpoint_assets-*.whl")
    return built


@pytest.mark.parametrize("end", ["newest", "oldest"])
@pytest.mark.slow
def test_the_wheel_installs_beside_dagster_at_either_end_of_its_range_and_changes_none_of_it(
    tmp_path: Path, end: str, wheel: Path
) -> None:
    venv = tmp_path / "venv"
    requirement = _dagster_requirement()
    oldest = next(s.version for s in requirement.specifier if s.operator == ">=")
    dagster = str(requirement) if end == "newest" else f"dagster=={oldest}"
    python = venv_with(venv, dagster, *_other_requirements())
    before = _dagster_versions(python)
    assert before["dagster"] in requirement.specifier
    assert (before["dagster"] == oldest) == (end == "oldest")

    _run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel)
    assert _dagster_versions(python) == before

    project = tmp_path / "project"
    project.mkdir()
    (project / "defs.py").write_text(DEFS % str(tmp_path / "checkpoints"))
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    cli = venv / "bin" / "dagster"

    # The source and a shard in one run, each step in a process of its own (the default).
    select = ("--select", "numbers,doubled", "--partition", "0-of-2")
    log = _run(cli, "asset", "materialize", "-f", "defs.py", *select, cwd=project, env=env)
    # A run succeeds only when each of its steps did. The steps' own log lines are not checked:
    # Dagster copies a step's output to the console through `tail -F`, which may drop lines.
    assert "RUN_SUCCESS" in log
    assert "version mismatch" not in log.lower()
    checkpoints = str(tmp_path / "checkpoints")
    assert Path(checkpoints, output_name(["numbers"], None)).is_file()
    merged = Files.under(checkpoints, checkpoint_name(["doubled"], None, "0-of-2")).merged
    assert Path(merged).is_file()  # the shard finalized


def _requirements() -> list[Requirement]:
    """The package's own requirements, read from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def _dagster_requirement() -> Requirement:
    return next(r for r in _requirements() if r.name == "dagster")


def _other_requirements() -> list[str]:
    return [str(r) for r in _requirements() if r.name != "dagster"]
