"""ARCHITECTURE.md against the code: every path it names exists, every module of the package is
in its tables, its room diagrams are the `layers` contracts of pyproject.toml, and its import
claims hold (a module that "imports nothing else of the package", one that imports "only" some
others, the launcher nothing imports, `tests/engine/` without Dagster). Imports are read from the
source, those under ``if TYPE_CHECKING:`` included: an annotation ties modules as well."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "checkpoint_assets"
DOC = ROOT / "ARCHITECTURE.md"
# Where a section's bare paths are (the others: from the repository's root or the package).
SECTION_BASES = {
    "The engine, room by room": PACKAGE / "engine",
    "The CLI, command by command": PACKAGE / "cli",
    "The Dagster side, room by room": PACKAGE / "integration",
}
PATH = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")
FILE = re.compile(r"\.(py|md|toml|yaml|yml|json)$")


def sections() -> dict[str, str]:
    """ARCHITECTURE.md by ``## `` heading (the text before the first: "")."""
    parts = re.split(r"^## (.+)$", DOC.read_text(), flags=re.MULTILINE)
    return {"": parts[0], **dict(zip(parts[1::2], parts[2::2], strict=True))}


def named_paths(text: str) -> set[str]:
    """The paths in backticks: anything with a slash, or a file name (``status.py``)."""
    tokens = re.findall(r"`([^`\s]+)`", text)
    return {t for t in tokens if PATH.match(t) and ("/" in t or FILE.search(t))}


def resolve(path: str, base: Path | None) -> Path | None:
    """Where ``path`` is: under ``base``, the repository or the package; a bare file name (the
    text names its folder around it) anywhere in the package, the examples or the tests."""
    for folder in (base, ROOT, PACKAGE):
        if folder is not None and (folder / path).exists():
            return folder / path
    if "/" not in path:
        for folder in (PACKAGE, ROOT / "examples", ROOT / "tests"):
            if found := next(folder.rglob(path), None):
                return found
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def package_imports(path: Path) -> frozenset[str]:
    """The modules of the package that the file at ``path`` imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{node.module}" if node.module else anchor
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    modules = {m for m in found if m.startswith("checkpoint_assets.") and _is_module(m)}
    return frozenset(modules - {name})


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def table_rows(text: str) -> list[tuple[str, str]]:
    """(first cell, second cell) of each row of the section's tables."""
    rows = re.findall(r"^\| (.+?) \| (.+) \|$", text, flags=re.MULTILINE)
    return [(a, b) for a, b in rows if a not in ("file", "---")]


def modules(room: Path) -> list[Path]:
    return sorted(p for p in room.rglob("*.py") if p.name != "__init__.py")


def test_every_path_it_names_exists() -> None:
    missing = [
        (heading, path)
        for heading, text in sections().items()
        for path in sorted(named_paths(text))
        if resolve(path, SECTION_BASES.get(heading)) is None
    ]
    assert not missing, f"ARCHITECTURE.md names paths that do not exist: {missing}"


@pytest.mark.parametrize("heading", SECTION_BASES)
def test_every_module_of_a_room_is_in_its_table(heading: str) -> None:
    base = SECTION_BASES[heading]
    named = set()
    for first, _ in table_rows(sections()[heading]):
        named.update(named_paths(first))
    unnamed = [
        str(p.relative_to(base))
        for p in modules(base)
        if not {str(p.relative_to(base)), f"{p.parent.relative_to(base)}/"} & named
    ]
    assert not unnamed, f"modules missing from ARCHITECTURE.md's '{heading}': {unnamed}"


@pytest.mark.parametrize(
    ("heading", "container"),
    [
        ("The engine, room by room", "checkpoint_assets.engine"),
        ("The Dagster side, room by room", "checkpoint_assets.integration"),
    ],
)
def test_the_room_diagram_is_the_layers_contract(heading: str, container: str) -> None:
    diagram = re.search(r"top to bottom.*?```\n(.*?)```", sections()[heading], flags=re.DOTALL)
    assert diagram, heading
    drawn = [
        " | ".join(room.strip().removesuffix("/").removesuffix(".py") for room in line.split("|"))
        for line in diagram[1].strip().splitlines()
    ]
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in contracts["contracts"] if c.get("containers") == [container]]
    assert drawn == layers


def test_its_import_claims_hold() -> None:
    claims = 0
    for heading, base in SECTION_BASES.items():
        for first, second in table_rows(sections()[heading]):
            paths = [resolve(p, base) for p in named_paths(first)]
            if "imports nothing else of the package" in second:
                allowed: set[str] = set()
            elif only := re.search(r"imports only ((?:`[^`]+`(?:,? (?:and )?)?)+)", second):
                allowed = {module_name(resolve(p, base)) for p in named_paths(only[1])}  # type: ignore[arg-type]
            else:
                continue
            for path in paths:
                assert path is not None, first
                claims += 1
                imported = package_imports(path)
                assert imported <= allowed, f"{first}: imports {sorted(imported - allowed)}"
    assert claims, "no import claim found: the test reads ARCHITECTURE.md's wording"


def test_nothing_in_the_package_imports_the_ray_launcher() -> None:
    (row,) = [r for r in table_rows(sections()["The Dagster side, room by room"]) if "ray" in r[0]]
    assert "nothing in the package imports it" in row[1]
    launcher = module_name(PACKAGE / "integration" / row[0].strip("`"))
    importers = [str(p) for p in PACKAGE.rglob("*.py") if launcher in package_imports(p)]
    assert not importers


def test_the_engine_tests_are_in_the_folders_of_its_rooms() -> None:
    """`tests/engine/<room>/` for `checkpoint_assets/engine/<room>/` (or `<room>.py`)."""
    tests = ROOT / "tests" / "engine"
    outside = [str(p.relative_to(tests)) for p in tests.glob("*.py")]
    assert not outside, f"move these into the folder of the engine's room they test: {outside}"
    rooms = {p.stem for p in (PACKAGE / "engine").iterdir() if p.suffix == ".py" or p.is_dir()}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= rooms, f"not rooms of the engine: {sorted(folders - rooms)}"


def test_the_engine_tests_run_without_dagster() -> None:
    """What `tests/engine/ (no Dagster)` says: its modules are collected with Dagster made
    unimportable (a test that needs Dagster belongs in tests/integration/)."""
    assert "`tests/engine/` (no Dagster)" in DOC.read_text()
    code = (
        "import sys; sys.modules['dagster'] = None; import pytest; sys.exit(pytest.main(["
        "'--collect-only', '-q', '-p', 'no:cacheprovider', '-p', 'no:xdist', 'tests/engine']))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-4000:]
