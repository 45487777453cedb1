"""The documentation in docs/ stays true and complete.

- Every export and every error has its entry in the generated reference (docs/reference/), and
  no materialization records a metadata key that is not declared.
- The README's links resolve (the site's are checked by `mkdocs build --strict`).
- docs/tutorial.md runs as written: its Python blocks become a project in a temporary folder, its
  commands run against a temporary DAGSTER_HOME, and what its prose promises is checked.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

import checkpoint_assets
from checkpoint_assets.engine import errors as engine_errors
from checkpoint_assets.engine.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TUTORIAL = (DOCS / "tutorial.md").read_text()
BIN = Path(sys.executable).parent


# -- reading Markdown ------------------------------------------------------------------------
def fences(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


# -- the generated references ---------------------------------------------------------------
# docs/reference/ is generated from the code (mkdocs.yml; `mkdocs build --strict` in scripts/lint
# fails on a name it cannot render). What stays to check here is what the build cannot see.
def public_errors() -> list[type[CheckpointError]]:
    exported = [getattr(checkpoint_assets, n) for n in checkpoint_assets.__all__]
    defined = [v for v in vars(engine_errors).values() if isinstance(v, type)]
    return sorted(
        {c for c in exported + defined if isinstance(c, type) and issubclass(c, CheckpointError)},
        key=lambda c: c.__name__,
    )


def test_every_error_class_is_exported() -> None:
    missing = [c.__name__ for c in public_errors() if c.__name__ not in checkpoint_assets.__all__]
    assert not missing, f"error classes not exported by checkpoint_assets: {missing}"


def test_every_error_is_on_the_errors_page() -> None:
    page = (DOCS / "reference" / "errors.md").read_text()
    missing = [c.__name__ for c in public_errors() if f"errors.{c.__name__}\n" not in page]
    assert not missing, f"errors missing from docs/reference/errors.md: {missing}"


def test_every_export_is_in_the_reference() -> None:
    pages = "".join(p.read_text() for p in (DOCS / "reference").glob("*.md"))
    errors = {c.__name__ for c in public_errors()}
    missing = [
        name
        for name in checkpoint_assets.__all__
        if name not in errors
        and not re.search(rf"^::: checkpoint_assets\.\S*\b{name}$", pages, re.M)
    ]
    assert not missing, f"exports missing from docs/reference/: {missing}"


def test_an_undeclared_metadata_key_is_refused() -> None:
    from checkpoint_assets.integration import metadata as md

    assert md.declared({"rows_total": 1, "usage/tokens": 2.0}, md.MATERIALIZATION)
    with pytest.raises(RuntimeError, match=r"\['rows_secret'\] are not declared"):
        md.declared({"rows_total": 1, "rows_secret": 2}, md.MATERIALIZATION)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of the headings of ``text``."""
    out = set()
    for heading in re.findall(r"^#+\s+(.*)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_the_readmes_links_resolve() -> None:
    """The README is read on the repository's page, outside the site that mkdocs checks."""
    for page in [ROOT / "README.md"]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: broken link {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked.read_text()), f"{page.name}: no anchor {target}"


# -- (d): the tutorial runs as written -------------------------------------------------------
def tutorial_sections() -> list[tuple[str, str]]:
    """(title, body) of each ``##`` section of the tutorial, in order."""
    parts = re.split(r"^## (.*)$", TUTORIAL, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def commands(body: str) -> list[str]:
    """The shell commands of a section's bash blocks, continuation lines joined."""
    out: list[str] = []
    for block in fences(body, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def twins(body: str) -> list[str]:
    """The ``dg launch`` commands given beside others as ``# or: dg launch ...`` comments."""
    return [m[1] for m in re.finditer(r"^\s*# or: (dg launch .*)$", body, flags=re.M)]


def test_every_dagster_asset_materialize_has_its_dg_launch_twin() -> None:
    """`dagster asset materialize` prints a SupersessionWarning naming `dg launch`: every one
    the documents show has the same run as `dg launch` beside it."""
    flag = r"--(?:select|assets) (\S+)|--partition (\S+)|-m (\S+)"

    def run(cmd: str) -> tuple[str, ...]:
        found = {
            k: v
            for m in re.finditer(flag, cmd)
            for k, v in zip("spm", m.groups(), strict=True)
            if v
        }
        return (found.get("s", ""), found.get("p", ""), found.get("m", ""))

    for doc in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for block in fences(doc.read_text(), "bash"):
            launched = {run(c) for c in twins(block)}
            for line in block.splitlines():
                if line.strip().startswith("dagster asset materialize"):
                    assert run(line) in launched, f"{doc.name}: no dg launch twin of {line!r}"


def command(body: str, *words: str) -> str:
    """The one command of ``body`` that contains every one of ``words``."""
    found = [c for c in commands(body) if all(w in c for w in words)]
    assert len(found) == 1, f"tutorial: expected one command with {words}, found {found}"
    return found[0]


def forget_project() -> None:
    """Drop the tutorial's modules, so that the next import reads the files again."""
    for name in [m for m in sys.modules if m == "my_project" or m.startswith("my_project.")]:
        del sys.modules[name]


class Tutorial:
    """The tutorial's project in a temporary folder, and a Dagster instance in its home."""

    def __init__(self, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.folder = folder
        self.home = folder / "dagster_home"
        self.monkeypatch = monkeypatch
        self.env = {
            **os.environ,
            "DAGSTER_HOME": str(self.home),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            # The checkout under test, not whichever one the venv's scripts were installed from.
            "PYTHONPATH": f"{folder}{os.pathsep}{ROOT}",
        }
        monkeypatch.setenv("DAGSTER_HOME", str(self.home))
        monkeypatch.syspath_prepend(str(folder))
        self._instance: dg.DagsterInstance | None = None
        self.defs: dg.Definitions | None = None
        self.result: dg.ExecuteInProcessResult | None = None
        self.cursor: str | None = None  # the sensor's

    def write(self, body: str) -> None:
        """Write the section's Python blocks, each to the file its first line names."""
        for block in fences(body, "python"):
            first = block.splitlines()[0]
            match = re.fullmatch(r"# (my_project/\w+\.py)", first)
            assert match, f"tutorial: a Python block must start with its file name: {first!r}"
            path = self.folder / match[1]
            path.parent.mkdir(parents=True, exist_ok=True)
            (path.parent / "__init__.py").touch()
            path.write_text(block)
        self.defs = None  # load the new code

    @property
    def instance(self) -> dg.DagsterInstance:
        if self._instance is None:
            self._instance = dg.DagsterInstance.from_config(str(self.home))
        return self._instance

    def definitions(self) -> dg.Definitions:
        if self.defs is None:
            forget_project()
            importlib.invalidate_caches()
            module = importlib.import_module("my_project.definitions")
            # The model's latency is for people watching; in process the test needs none.
            self.monkeypatch.setattr("my_project.model.SECONDS_PER_CALL", 0.0)
            self.defs = module.defs
        return self.defs

    def run(self, cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A command of the tutorial, as written, in the project folder."""
        done = subprocess.run(
            ["bash", "-c", cmd],
            cwd=self.folder,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"{cmd}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        return done

    def materialize(self, select: str, partition: str | None = None) -> dict[str, Any]:
        """What ``dagster asset materialize --select S --partition P`` does, in process; returns
        the metadata of the materialization."""
        defs = self.definitions()
        result = dg.materialize(
            list(defs.assets or []),
            selection=select,
            partition_key=partition,
            instance=self.instance,
            resources=defs.resources,
        )
        assert result.success
        self.result = result
        (event,) = result.get_asset_materialization_events()
        metadata = event.materialization.metadata
        return {k: getattr(v, "value", v) for k, v in metadata.items()}

    def shard_keys(self) -> list[str]:
        defs = self.definitions()
        asset = defs.resolve_assets_def("ticket_routing")
        assert asset.partitions_def is not None
        return list(asset.partitions_def.get_partition_keys())

    def sensor_requests(self, now: float) -> list[str]:
        """The partitions the failed-partitions sensor asks to run, its clock set to ``now``."""
        from checkpoint_assets.integration.watch import sensor as sensor_module

        defs = self.definitions()
        sensor = defs.resolve_sensor_def("ticket_routing_failed_partitions")
        self.monkeypatch.setattr(sensor_module, "time", _Clock(now))
        context = dg.build_sensor_context(
            instance=self.instance, cursor=self.cursor, definitions=defs
        )
        result = sensor(context)
        assert isinstance(result, dg.SensorResult)
        self.cursor = result.cursor
        return sorted(str(r.partition_key) for r in result.run_requests or [])


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def tutorial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tutorial]:
    t = Tutorial(tmp_path, monkeypatch)
    yield t
    if t._instance is not None:
        t._instance.dispose()
    forget_project()


@pytest.mark.slow
def test_the_tutorial_runs_as_written(tutorial: Tutorial) -> None:
    checkpoints = tutorial.home / "checkpoints"
    failed: dict[str, int] = {}  # failed rows per shard, as last materialized

    def install(body: str) -> None:
        assert "pip install" in body  # the package is installed in this environment

    def dagster_home(body: str) -> None:
        assert "export DAGSTER_HOME=$PWD/dagster_home" in commands(body)
        tutorial.run(command(body, "mkdir"))
        tutorial.run(command(body, "dagster.yaml"))
        # The dg twin of `dagster asset materialize` (the interrupt below runs that one), as
        # written: with the home's dagster.yaml, neither command warns.
        assert "-m my_project.definitions" in command(body, "--select tickets")
        [launch] = [c for c in twins(body) if "--assets tickets" in c]
        done = tutorial.run(launch)
        assert "No dagster instance configuration" not in done.stdout + done.stderr
        assert "SupersessionWarning" not in done.stdout + done.stderr
        assert (checkpoints / "tickets.parquet").exists()

    def one_shard(body: str) -> None:
        shard = re.search(r"--partition (\S+)", command(body, "--select ticket_routing"))
        assert shard is not None
        metadata = tutorial.materialize("ticket_routing", shard[1])
        assert 0 < metadata["rows_failed"] <= 0.01 * metadata["rows_total"]
        assert metadata["rows_computed"] == metadata["rows_total"] > 900
        failed[shard[1]] = metadata["rows_failed"]

    def interrupt(body: str) -> None:
        cmd = command(body, "--select ticket_routing")
        shard = cmd.split("--partition ")[1].split()[0]
        parts = checkpoints / "ticket_routing" / "default" / f"{shard}.parquet.parts"
        process = subprocess.Popen(
            shlex.split(cmd),
            cwd=tutorial.folder,
            env=tutorial.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            _wait_for(lambda: parts.is_dir() and any(parts.iterdir()), "the first flush")
            process.send_signal(signal.SIGINT)  # Ctrl-C
            output, _ = process.communicate(timeout=60)
        finally:
            process.kill()
        assert process.returncode != 0, output[-3000:]
        # Run the same command again: it resumes.
        metadata = tutorial.materialize("ticket_routing", shard)
        assert metadata["rows_resumed"] > 0, metadata
        assert metadata["rows_computed"] + metadata["rows_resumed"] == metadata["rows_total"]
        assert f"{shard}: resuming;" in body
        failed[shard] = metadata["rows_failed"]

    def look(body: str) -> None:
        status = tutorial.run(command(body, "status")).stdout
        for shard in failed:
            assert re.search(rf"ticket_routing\s+default\s+{shard}\s", status), status
        inspect = [c for c in commands(body) if "inspect" in c]
        assert len(inspect) == 2
        for cmd in inspect:
            out = tutorial.run(cmd).stdout
            if cmd.endswith("--failed"):
                ids = out.split()
                assert ids and all(int(i) % 500 == 7 for i in ids), ids  # the empty tickets
            else:
                assert "cannot route a ticket without a body" in out, out

    def backfill(body: str) -> None:
        loop = " ".join(commands(body))
        assert "for shard in" in loop
        listed = re.search(r"for shard in ([^;]+);", loop)
        assert listed is not None
        assert listed[1].split() == tutorial.shard_keys()
        for shard in listed[1].split():
            failed[shard] = tutorial.materialize("ticket_routing", shard)["rows_failed"]

    def sensor(body: str) -> None:
        tutorial.write(body.split("Fix the cause")[0])
        assert tutorial.sensor_requests(time.time()) == []  # within the backoff
        # Each shard that materialized with failed rows gets a retry, after the backoff.
        assert sorted(failed) == tutorial.shard_keys()
        retried = sorted(shard for shard, rows in failed.items() if rows)
        clock = time.time() + 31
        assert tutorial.sensor_requests(clock) == retried
        for shard in retried:  # the retries fail the same rows again
            assert tutorial.materialize("ticket_routing", shard)["rows_failed"] == failed[shard]
        clock += 61
        assert tutorial.sensor_requests(clock) == retried
        for shard in retried:
            tutorial.materialize("ticket_routing", shard)
        clock += 121
        assert tutorial.sensor_requests(clock) == []  # it gave up
        # The fix: every failed row computed again, nothing else.
        tutorial.write(body.split("Fix the cause")[1])
        for shard in failed:
            metadata = tutorial.materialize("ticket_routing", shard)
            assert metadata["rows_failed"] == 0
            assert metadata["rows_computed"] == failed[shard]
            assert metadata["function_changed"] is False  # the fix is in a helper it calls
        assert tutorial.sensor_requests(clock + 1000) == []
        assert "--select departments" in command(body, "--select departments")
        tutorial.materialize("departments")
        table = tutorial.result.output_for_node("departments")
        assert table["tickets"].sum() == 4000  # every shard, read as one table

    def nothing(body: str) -> None:
        pass

    steps: dict[str, Callable[[str], None]] = {
        "Install": install,
        "The model": nothing,
        "The assets": nothing,
        "A Dagster home": dagster_home,
        "Materialize one shard": one_shard,
        "Interrupt it and resume": interrupt,
        "Look at the checkpoints": look,
        "Backfill every shard": backfill,
        "Retry failed rows with the sensor": sensor,
        "Where next": nothing,
    }
    for title, body in tutorial_sections():
        assert title in steps, f"tutorial section {title!r} has no step in this test"
        started = time.monotonic()
        if steps[title] is not sensor:
            tutorial.write(body)
        steps[title](body)
        print(f"{title}: {time.monotonic() - started:.1f} s")
