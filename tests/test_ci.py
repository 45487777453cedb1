"""What `.ci/run` runs again at the oldest Dagster of the range names tests that exist: a test
renamed or moved would otherwise make that run collect nothing and fail CI with pytest's exit
status 5, after the whole suite has passed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _named() -> list[str]:
    """The test files and node ids the oldest-Dagster run of `.ci/run` passes to pytest."""
    text = (ROOT / ".ci" / "run").read_text()
    folder = re.search(r"^integration=(\S+)$", text, flags=re.M)
    assert folder, "integration=... not found in .ci/run"
    return [folder[1] + rest for rest in re.findall(r'\$integration(/[^\s"]+)', text)]


def test_every_file_and_test_the_oldest_dagster_run_names_exists() -> None:
    named = _named()
    assert len(named) > 10
    missing = [n for n in named if not (ROOT / n.split("::")[0]).is_file()]
    assert not missing, f".ci/run names files that do not exist: {missing}"
    ids = [n for n in named if "::" in n]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "-n", "0", *ids],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"{len(ids)} tests collected" in done.stdout, done.stdout[-2000:]
