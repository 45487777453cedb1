"""New venvs for the install tests, filled by uv.

uv installs a set of packages in a tenth of pip's time. The tests use it only to make the state
a user starts from (a venv that already holds Dagster, or the image's pinned packages); the step
under test then runs with pip, as the user runs it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from uv import find_uv_bin


def venv_with(path: Path, *requirements: str) -> Path:
    """A new venv of this Python at ``path``, with pip and ``requirements``; returns its python."""
    uv = find_uv_bin()
    subprocess.run(
        [uv, "venv", "-q", "--seed", "--python", sys.executable, str(path)],
        check=True,
        capture_output=True,
    )
    python = path / "bin" / "python"
    if requirements:
        done = subprocess.run(
            [uv, "pip", "install", "-q", "--python", str(python), *requirements],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"uv pip install {requirements}: {done.stderr[-3000:]}"
    return python
