"""What a release carries: its version, as the installed package reports it, and its section of
CHANGELOG.md (.github/workflows/release.yml refuses a tag without one)."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_command_line_prints_the_installed_version() -> None:
    cli = Path(sys.executable).parent / "checkpoint-assets"
    done = subprocess.run([cli, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"checkpoint-assets {version('checkpoint-assets')}\n"


def test_the_changelog_opens_with_unreleased_then_one_section_per_release() -> None:
    headings = re.findall(r"^## (.*)$", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert headings[0] == "[Unreleased]"
    released = headings[1:]
    assert released, "no released section"
    for heading in released:
        assert re.fullmatch(r"\[\d+\.\d+\.\d+\] - \d{4}-\d{2}-\d{2}", heading), heading
