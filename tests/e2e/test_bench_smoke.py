"""The benchmark runs end to end at tiny sizes and records every scenario (no timings asserted).

``bench/run.py`` is how the figures of docs/performance.md are produced; this keeps it working
as the engine changes. It runs the real thing in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = {"overhead", "per_call", "resume", "memory", "compaction", "s3_requests", "hashing"}
SCENARIOS |= {"ray", "distribatch"}
SCENARIOS |= {"remote", "openai", "throttled", "kill"}
SCENARIOS |= {"reshard", "global_table"}
SCENARIOS |= {"random 429 1%", "random 429 5%", "random 429 20%", "limit 32 from 64"}
SCENARIOS |= {"limit 32>8>32", "limit 32>8>32, 5% 429", "no 429"}
SCENARIOS |= {"limit 32 from 64, 250 ms", "limit 32>8>32, 250 ms", "no 429, 250 ms"}
SCENARIOS |= {"random 429 5%, 250 ms"}


def test_the_smoke_benchmark_writes_every_scenario_as_json(tmp_path: Path) -> None:
    results = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--results", str(results)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )

    assert done.returncode == 0, done.stderr[-4000:]
    files = list(results.glob("*.json"))
    assert len(files) == 1
    report = json.loads(files[0].read_text())
    assert set(report["scenarios"]) == SCENARIOS
    for key, scenario in report["scenarios"].items():
        assert scenario["status"] in ("ok", "skipped"), (key, scenario["note"])
        if scenario["status"] == "ok":
            assert scenario["figures"], key
            assert all(f["value"] is not None for f in scenario["figures"]), key
    for peer in ("ray", "distribatch"):
        assert report["scenarios"][peer]["note"] or report["scenarios"][peer]["figures"]
    assert "scenario" in done.stdout and "resume" in done.stdout  # the table
