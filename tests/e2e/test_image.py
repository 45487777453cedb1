"""The images build from what the repository holds, and install what the tests ran against: the
user-code image (deploy/kubernetes/Dockerfile, also the ECS image's base) and the Ray image
(deploy/ray/Dockerfile).

Docker itself is not needed: every path a Dockerfile copies must exist and reach the build
context through .dockerignore (read with Docker's rules, below), the context must leave out .venv
and the other local state, each constraints file must pin what pyproject.toml pins, and each
Dockerfile's pip lines, run as written in a new venv, install and pass `pip check`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path, PurePosixPath

import pytest
from deploy_services import ROOT
from helpers.venvs import venv_with
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from uv import find_uv_bin

DOCKERFILE = ROOT / "deploy" / "kubernetes" / "Dockerfile"
RAY_DOCKERFILE = ROOT / "deploy" / "ray" / "Dockerfile"
# The ECS image adds the instance and workspace config to the user-code image.
DOCKERFILES = [DOCKERFILE, ROOT / "deploy" / "ecs" / "Dockerfile", RAY_DOCKERFILE]
CONSTRAINTS = ROOT / "deploy" / "kubernetes" / "constraints.txt"
# The images that install the package: Dockerfile, its constraints file, the extras it installs.
IMAGES = {
    "kubernetes": (DOCKERFILE, CONSTRAINTS, ("k8s", "postgres", "s3", "ui")),
    "ray": (
        RAY_DOCKERFILE,
        ROOT / "deploy" / "ray" / "constraints.txt",
        ("ray", "postgres", "s3", "ui"),
    ),
}
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


@pytest.mark.parametrize("image", IMAGES)
def test_the_image_is_pinned_and_runs_as_a_user(image: str) -> None:
    dockerfile, constraints, extras = IMAGES[image]
    instructions = _instructions(dockerfile)
    (base,) = [args for op, args in instructions if op == "FROM"]
    assert re.fullmatch(r"\S+@sha256:[0-9a-f]{64}", base), f"base image not pinned: {base}"
    users = [args for op, args in instructions if op == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}, "the image runs as root"
    runs = " ".join(args for op, args in instructions if op == "RUN")
    # Every pip install is held to the constraints, which the Dockerfile copies in.
    installs = re.findall(r"pip install [^&]*", runs)
    assert installs and all("/tmp/constraints.txt" in i for i in installs), installs
    assert str(constraints.relative_to(ROOT)) in _copied(dockerfile)
    # The package is installed with the extras its constraints were written for.
    assert f'"/tmp/src[{",".join(extras)}]"' in runs, runs


def test_the_ray_image_is_the_python_of_the_user_code_image() -> None:
    # One Python and Debian for the code server and the Ray nodes that run its code.
    bases = {next(a for op, a in _instructions(d) if op == "FROM") for d, _, _ in IMAGES.values()}
    assert len(bases) == 1, bases


def _image_env(dockerfile: Path) -> dict[str, str]:
    """The variables a Dockerfile's ENV instructions set."""
    env: dict[str, str] = {}
    for op, args in _instructions(dockerfile):
        if op == "ENV":
            env |= dict(word.split("=", 1) for word in shlex.split(args))
    return env


def test_the_ray_image_holds_the_ray_instance_config_and_defaults_for_its_settings() -> None:
    """Every variable deploy/ray/dagster.yaml reads is either defaulted by the image or named in
    the file's header for the operator to set, and the image's defaults are variables it reads."""
    text = (ROOT / "deploy" / "ray" / "dagster.yaml").read_text()
    read = set(re.findall(r"^\s*(?:- )?env: (\w+)$", text, re.M))
    header = text[: text.index("run_launcher:")]
    env = _image_env(RAY_DOCKERFILE)
    assert ("deploy/ray/dagster.yaml", f"{env['DAGSTER_HOME']}/dagster.yaml") in [
        tuple(shlex.split(a)) for op, a in _instructions(RAY_DOCKERFILE) if op == "COPY"
    ]
    defaulted = {"DAGSTER_RAY_PY_MODULES", "DAGSTER_MAX_CONCURRENT_RUNS"}
    assert defaulted <= read and defaulted <= env.keys()
    assert env["DAGSTER_RAY_PY_MODULES"] == ""  # the code is in the image: nothing uploaded
    assert int(env["DAGSTER_MAX_CONCURRENT_RUNS"]) > 0
    for name in read - env.keys():
        assert name in header, f"dagster.yaml reads {name}, which its header does not name"
    # Ray refuses clients without the cluster's token (docs/deploying.md, "Ray").
    assert env["RAY_AUTH_MODE"] == "token"


def _constraints(path: Path = CONSTRAINTS) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


@pytest.mark.parametrize("image", IMAGES)
def test_constraints_pin_the_tested_dagster_and_satisfy_pyproject(image: str) -> None:
    _, constraints, image_extras = IMAGES[image]
    pins = _constraints(constraints)
    assert pins["dagster"] == DAGSTER
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    needed = [
        Requirement(r)
        for r in project["dependencies"] + [r for e in image_extras for r in extras[e]]
    ]
    for req in needed:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is a requirement but not in {constraints}"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{constraints} pins {req.name}=={pins[name]}, outside pyproject's {req}: "
            "run scripts/constraints.py"
        )
    # Only what the image installs: no test tools, not the project itself.
    assert not {"pytest", "moto", "checkpoint-assets"} & pins.keys()


def _lay_out(dockerfile: Path, root: Path) -> list[str]:
    """Copy what ``dockerfile`` copies from the context (as .dockerignore lets it through) under
    ``root`` instead of ``/``, up to its last pip install; returns its RUN lines up to there."""
    instructions = _instructions(dockerfile)
    last = max(i for i, (op, args) in enumerate(instructions) if op == "RUN" and "pip " in args)
    workdir, runs = PurePosixPath("/"), []
    for op, args in instructions[: last + 1]:
        if op == "WORKDIR":
            workdir = workdir / args
        elif op == "RUN":
            runs.append(args)
        elif op == "COPY":
            *sources, dest = shlex.split(args)
            target = root / str(workdir / dest).lstrip("/")
            for source in sources:
                into = target / Path(source).name if dest.endswith("/") else target
                into.parent.mkdir(parents=True, exist_ok=True)
                if (ROOT / source).is_dir():

                    def ignored(folder: str, names: list[str]) -> set[str]:
                        rel = Path(folder).relative_to(ROOT)
                        return {n for n in names if excluded(str(rel / n))}

                    shutil.copytree(ROOT / source, into, ignore=ignored)
                else:
                    shutil.copy(ROOT / source, into)
    return runs


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("image", IMAGES)
def test_the_dockerfile_pip_lines_install_in_a_new_venv(image: str, tmp_path: Path) -> None:
    """The image's RUN lines up to its last pip install, as written (paths under a temp root for
    /), in a new venv of this Python: the constraints resolve, the package installs with its
    extras, and `pip check` passes.

    uv first installs the constraints file into the venv, as the image's first pip line does, in
    a tenth of the time. pip then runs every line as written: it must find each pin already
    satisfied and add the package alone, so the constraints hold everything the image needs."""
    dockerfile, _, extras = IMAGES[image]
    root = tmp_path / "root"
    runs = _lay_out(dockerfile, root)
    venv = tmp_path / "venv"
    python = venv_with(venv, "--requirement", str(root / "tmp" / "constraints.txt"))
    before = _installed(python)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env["PIP_NO_COMPILE"] = "1"  # no .pyc files: what installs is the same, at a fifth less CPU
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    for line in runs:
        command = re.sub(r"(?<![\w.])/tmp/", f"{root}/tmp/", line)
        done = subprocess.run(
            ["bash", "-c", command], env=env, capture_output=True, text=True, cwd=tmp_path
        )
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    after = _installed(python)
    assert {k: v for k, v in after.items() if k in before} == before, "pip changed a pin"
    assert after.keys() - before.keys() == {"checkpoint-assets"}, "needed outside constraints"
    shown = subprocess.run(
        [python, "-m", "pip", "show", "checkpoint-assets", *_extra_modules(extras)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Name: checkpoint-assets" in shown
    assert not (root / "tmp" / "src").exists(), "the image keeps its build copy"


def _installed(python: Path) -> dict[str, str]:
    """Every distribution of a venv and its version, by canonical name (read by uv: pip's own
    start would take a second)."""
    listed = subprocess.run(
        [find_uv_bin(), "pip", "list", "--format", "json", "--python", python],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {canonicalize_name(d["name"]): d["version"] for d in json.loads(listed)}


def _extra_modules(extras: tuple[str, ...]) -> list[str]:
    """A distribution each extra brings, which `pip show` must find."""
    brings = {"ray": "dagster-ray", "k8s": "dagster-k8s", "postgres": "dagster-postgres"}
    return [brings[e] for e in extras if e in brings]


def test_dockerignore_reading_follows_dockers_rules() -> None:
    pattern = _pattern("**/__pycache__")
    assert pattern.match("__pycache__") and pattern.match("a/b/__pycache__")
    assert not _pattern("*.md").match("docs/reference.md")
    assert _pattern("docs/*.md").match("docs/reference.md")
