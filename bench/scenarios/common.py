"""What every scenario shares: the sizes, and how a figure is timed (medians, rounds whose
order alternates, children in their own process)."""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Sizes:
    """Every size the scenarios use (``--smoke`` makes them tiny)."""

    rows: int
    interval: int
    per_call_rows: int
    per_call_interval: int
    per_call_sleep: float
    resume_rows: tuple[int, ...]
    compaction_interval: int
    hash_rows: int
    repeat: int
    remote_rows: int = 3200
    reshard_rows: int = 1_000_000
    reshard_sample: int = 50
    global_rows: tuple[int, ...] = (10_000_000, 30_000_000)
    global_checkpoints: int = 256
    overhead_rounds: int = 5  # at least; more with a larger ``repeat``
    overhead_warmup: int = 1  # rounds first, not counted (a smoke run's figures mean nothing: 0)


def peer(result: Any, module: str, name: str, enabled: bool) -> ModuleType | None:
    """The module of a tool measured beside the package (Ray Data, distribatch), or None with
    ``result`` marked skipped: not installed (the ``bench`` extra), or a smoke run without
    ``--ray``."""
    try:
        found = importlib.import_module(module)
    except ImportError:
        result.status = "skipped"
        result.note = f'{name} is not installed (pip install -e ".[bench]" to compare with it)'
        return None
    if not enabled:
        result.status = "skipped"
        result.note = "skipped in smoke runs; pass --ray to run it"
        return None
    return found


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def alternating(sides: dict[str, Callable[[], Any]], repeat: int) -> dict[str, list[float]]:
    """Seconds of each side (and its CPU seconds, as ``"<side> cpu"``), ``repeat`` rounds (two
    at least); the order of the sides alternates from round to round, so neither always runs
    first (warm caches, or a burst of load, would favour one)."""
    seconds: dict[str, list[float]] = {key: [] for n in sides for key in (n, f"{n} cpu")}
    for i in range(max(2, repeat)):  # at least two: each side runs first once
        names = list(sides) if i % 2 == 0 else list(reversed(sides))
        for name in names:
            cpu = time.process_time()
            seconds[name].append(timed(sides[name]))
            # CPU seconds of this process (all its threads), which a busy machine does not
            # inflate the way it does wall time.
            seconds[f"{name} cpu"].append(time.process_time() - cpu)
    return seconds


def child(module: str, *args: str, timeout: float = 1800) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    payload: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return payload
