"""The user-code image (deploy/kubernetes/Dockerfile, also the ECS image) builds from what the
repository holds, and installs what the tests ran against.

Docker itself is not needed: every path the Dockerfile copies must exist and reach the build
context through .dockerignore (read with Docker's rules, below), the context must leave out .venv
and the other local state, and the constraints file must pin what pyproject.toml pins.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path, PurePosixPath

import pytest
from deploy_services import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

DOCKERFILE = ROOT / "deploy" / "kubernetes" / "Dockerfile"
# The ECS image adds the instance and workspace config to the image above.
DOCKERFILES = [DOCKERFILE, ROOT / "deploy" / "ecs" / "Dockerfile"]
CONSTRAINTS = ROOT / "deploy" / "kubernetes" / "constraints.txt"
DAGSTER = "1.13.27"


def _instructions(dockerfile: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def _copied(dockerfile: Path = DOCKERFILE) -> list[str]:
    """The sources of every COPY from the build context."""
    sources = []
    for op, args in _instructions(dockerfile):
        words = shlex.split(args)
        if op == "COPY" and not any(w.startswith("--from") for w in words):
            sources += [w for w in words[:-1] if not w.startswith("--")]
    return sources


def _pattern(glob: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go's filepath.Match, plus `**` for any number of folders)."""
    out, i = "", 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif glob.startswith("**", i):
            out, i = out + ".*", i + 2
        elif glob[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif glob[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(glob[i]), i + 1
    return re.compile(out + r"\Z")


def _rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keep = line.startswith("!")
            glob = str(PurePosixPath(line.lstrip("!").strip()))
            rules.append((keep, _pattern(glob.lstrip("/"))))
    return rules


def excluded(path: str) -> bool:
    """Whether Docker leaves `path` (relative to the root) out of the build context: the last
    pattern matching it, or a folder it is in, decides."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    out = False
    for keep, pattern in _rules():
        if any(pattern.match(c) for c in candidates):
            out = not keep
    return out


def test_the_image_copies_the_package_its_license_and_the_examples() -> None:
    assert {"LICENSE", "pyproject.toml", "checkpoint_assets", "examples"} <= set(_copied())


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_dockerfile_copies_is_in_the_build_context(dockerfile: Path) -> None:
    copied = _copied(dockerfile)
    assert copied
    for source in copied:
        assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which does not exist"
        assert not excluded(source), f"the Dockerfile copies {source}, which .dockerignore excludes"
        tracked = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "--", source],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert tracked, f"{source} is copied but not in the repository"
        lost = [f for f in tracked if excluded(f)]
        assert not lost, f".dockerignore keeps these files of {source} out of the image: {lost}"


@pytest.mark.parametrize(
    "path",
    [
        ".venv",
        ".venv/lib/python3.11/site-packages/dagster/__init__.py",
        ".git/HEAD",
        "dagster_home/storage/some-run/compute_logs/x.out",
        ".checkpoints/a/part-0.parquet",
        "bench/results/run.json",
        "checkpoint_assets/__pycache__/settings.cpython-311.pyc",
        ".pytest_cache/v/cache/nodeids",
        "tests/e2e/test_image.py",
    ],
)
def test_the_build_context_leaves_out_local_state(path: str) -> None:
    assert excluded(path)


def test_the_image_is_pinned_and_runs_as_a_user() -> None:
    instructions = _instructions()
    (base,) = [args for op, args in instructions if op == "FROM"]
    assert re.fullmatch(r"\S+@sha256:[0-9a-f]{64}", base), f"base image not pinned: {base}"
    users = [args for op, args in instructions if op == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}, "the image runs as root"
    runs = " ".join(args for op, args in instructions if op == "RUN")
    # Every pip install is held to the constraints, which the Dockerfile copies in.
    installs = re.findall(r"pip install [^&]*", runs)
    assert installs and all("/tmp/constraints.txt" in i for i in installs), installs
    assert "deploy/kubernetes/constraints.txt" in _copied()


def _constraints() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_the_tested_dagster_and_satisfy_pyproject() -> None:
    pins = _constraints()
    assert pins["dagster"] == DAGSTER
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    needed = [
        Requirement(r)
        for r in project["dependencies"]
        + [r for e in ("k8s", "postgres", "s3", "ui") for r in extras[e]]
    ]
    for req in needed:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is a requirement but not in {CONSTRAINTS.name}"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{CONSTRAINTS.name} pins {req.name}=={pins[name]}, outside pyproject's {req}: "
            "run scripts/constraints.py"
        )
    # Only what the image installs: no test tools, not the project itself.
    assert not {"pytest", "moto", "checkpoint-assets"} & pins.keys()


def test_dockerignore_reading_follows_dockers_rules() -> None:
    pattern = _pattern("**/__pycache__")
    assert pattern.match("__pycache__") and pattern.match("a/b/__pycache__")
    assert not _pattern("*.md").match("docs/reference.md")
    assert _pattern("docs/*.md").match("docs/reference.md")
