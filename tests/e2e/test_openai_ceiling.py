"""The client-ceiling benchmark runs end to end at a tiny size (no timing asserted)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("openai") is None:  # an optional extra; CI must have it
    if os.environ.get("CI") == "true":
        pytest.fail("openai is not installed: pip install -e '.[openai]'", pytrace=False)
    pytest.skip("openai is not installed: pip install -e '.[openai]'", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]


def test_the_ceiling_benchmark_measures_both_server_placements() -> None:
    tiny = ["--requests", "40", "--repeat", "1", "--concurrency", "8", "--latency-ms", "5"]
    done = subprocess.run(
        [sys.executable, "-m", "bench.openai_ceiling", *tiny, "--server", "both"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert done.returncode == 0, done.stderr[-4000:]
    for kind in ("process", "thread"):
        assert re.search(rf"server in a {kind} *: median +\d+ req/s", done.stdout), done.stdout
