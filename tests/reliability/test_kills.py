"""A hundred SIGKILLs in a row, at the worst moments, lose no finished row and pay for few calls.

A driver process (``helpers/kill_child.py``) forks one process per run of the same checkpoint and
kills it with SIGKILL at a point chosen by a seeded plan: inside a part write, between a part's
write and its rename (local) or PUT (S3), right after a part is durable, inside compaction (after
the compacted part, before deleting its inputs), inside finalize (after the merged file, before
deleting the parts; after the meta), while taking over the stale lock the previous kill left,
with 32 calls in flight, before or after a random storage request, and at a random moment. The
input grows from run to run, so each run has new work. After the last, clean run:

- every id is stored exactly once, with the value the function gives for it (it is deterministic
  in the id), no part is left and ``checkpoint-assets verify`` finds nothing;
- each kill made the next runs pay again for at most the documented loss
  (``Settings.loss_bound``): the rows buffered, the flush being written and the calls in
  flight, and for nothing at all when it came after the merged file was written or before the
  lock was taken.

Most kills go through the engine alone (a fork of a warm process costs milliseconds); a few, one
per point, go through Dagster's ``materialize`` of one shard of a checkpointed asset.

Settings (environment):

- ``CHECKPOINT_KILLS``: kills for the engine on local disk (default 100: 10 to 20 s on a busy
  2-core machine) and, unless ``CHECKPOINT_KILLS_S3`` says otherwise, on the moto S3 server
  (default 30 there, 15 to 20 s: each run makes real HTTP requests).
- ``CHECKPOINT_KILLS_DAGSTER``: kills per storage through Dagster (default 9, one per point that
  applies; marked slow).
- ``CHECKPOINT_KILLS_SEED``: the plan's seed (default 12); a failure names the seed and the run.

The long setting (about 5 min on local disk, 0.5 to 1 s per kill on S3 and through Dagster;
``--timeout 0`` lifts the suite's 5-minute limit per test)::

    CHECKPOINT_KILLS=1000 CHECKPOINT_KILLS_DAGSTER=20 \
        pytest tests/reliability/test_kills.py -s --timeout 0

prints, per storage, the figures: kills per point, rows checked, calls made and paid again,
against the bound.
"""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from helpers import kill_child
from helpers.jobs import Storage, ids_in_shard

from checkpoint_assets.cli import main as cli
from checkpoint_assets.engine import Checkpoint, open_store
from checkpoint_assets.engine.checkpoints.layout import checkpoint_name
from checkpoint_assets.engine.sharding.scheme import Shard

DRIVER = Path(kill_child.__file__)
KILLS = int(os.environ.get("CHECKPOINT_KILLS", "100"))
S3_KILLS = int(os.environ.get("CHECKPOINT_KILLS_S3", os.environ.get("CHECKPOINT_KILLS", "30")))
DAGSTER_KILLS = int(os.environ.get("CHECKPOINT_KILLS_DAGSTER", "9"))
SEED = int(os.environ.get("CHECKPOINT_KILLS_SEED", "12"))

# Kill points after which nothing computed may be paid for again: everything the run computed
# is in the merged file, or the run has not started computing.
NOTHING_LOST = {"finalize_merged", "finalize_meta", "lock_takeover"}


def plan(seed: int, kills: int, *, dagster: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Seeded cycles (a few more than ``kills``: a random point may come after the run ended)
    and the final clean run."""
    rng = random.Random(seed)
    points = [p for p in kill_child.POINTS if not (dagster and p == "compaction")]
    cycles: list[dict[str, Any]] = []
    rows = 0
    order: list[str] = []
    while len(cycles) < kills + kills // 4 + 2:
        if not order:
            order = rng.sample(points, len(points))
        point = order.pop()
        interval = rng.choice([1, 2, 4, 8])
        cycle: dict[str, Any] = {
            "point": point,
            "n": 1,
            "variant": rng.randrange(3),
            "interval": interval,
            "concurrency": rng.choice([1, 1, 2, 4]),
            "delay": 0.0,
            "seed": rng.randrange(2**31),
        }
        grow = rng.randint(max(8, 4 * interval), max(40, 4 * interval))
        if point in ("part_inside", "part_before_commit", "part_after_commit"):
            cycle["n"] = rng.randint(1, 3)
        elif point == "compaction":  # 56 unmerged parts start compaction
            cycle.update(interval=1, concurrency=1)
            grow = 160  # rows done while a part is written join the next one: fewer parts
        elif point == "in_flight":
            cycle.update(interval=rng.choice([1, 2]), concurrency=32, delay=0.05)
            cycle["n"] = rng.randint(1, 2)
            grow = 32 * cycle["interval"] * 3
        elif point == "random_op":
            cycle["n"] = rng.randint(1, 12)
        elif point == "random_time":
            cycle["delay"] = 0.002
            cycle["at"] = rng.uniform(0.0, 0.5 if dagster else 0.25)
        if dagster:
            grow *= 2  # one shard of two gets about half the rows
        rows += grow
        cycle["rows"] = rows
        cycles.append(cycle)
    final = {"point": "none", "n": 0, "interval": 4, "concurrency": 2, "delay": 0.0}
    final["rows"] = rows + 16
    return cycles, final


def drive(
    storage: Storage, tmp_path: Path, kills: int, *, dagster: bool
) -> tuple[list[dict[str, Any]], list[tuple[int, list[int]]], dict[str, Any]]:
    """Run the driver; returns its report, the calls logged ((cycle, ids) each) and the spec."""
    base_dir, options = storage
    cycles, final = plan(SEED + dagster, kills, dagster=dagster)
    spec = {
        "mode": "materialize" if dagster else "engine",
        "partition": Shard(1, kill_child.SHARDS).key if dagster else None,
        "base_dir": base_dir,
        "options": options,
        "kills": kills,
        "cycles": cycles,
        "final": final,
        "log": str(tmp_path / "calls.log"),
        "report": str(tmp_path / "report.json"),
        "stderr": str(tmp_path / "children.err"),
    }
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, str(DRIVER), str(spec_file)],
        capture_output=True,
        timeout=3600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},  # helpers.kills
    )
    errors = Path(spec["stderr"]).read_text() if Path(spec["stderr"]).exists() else ""
    assert done.returncode == 0, done.stderr.decode()[-3000:] + errors[-3000:]
    report: list[dict[str, Any]] = json.loads(Path(spec["report"]).read_text())
    bad = [(i + 1, r) for i, r in enumerate(report) if not r["killed"] and r["exit"] != 0]
    assert not bad, f"seed {SEED}: cycles failed: {bad}\n{errors[-3000:]}"
    calls = []
    for line in Path(spec["log"]).read_text().splitlines():
        label, ids = line.split("\t")
        calls.append((int(label), [int(i) for i in ids.split(",")]))
    return report, calls, spec


def check(
    storage: Storage,
    report: list[dict[str, Any]],
    calls: list[tuple[int, list[int]]],
    name: str,
    expected_ids: list[int],
    kills: int,
) -> dict[str, Any]:
    """Assert the checkpoint and the calls against the promises; returns the figures."""
    assert sum(r["killed"] for r in report) == kills
    assert not report[-1]["killed"] and report[-1]["cycle"]["point"] == "none"

    # Every id stored once, with its value; nothing left over; verify finds nothing.
    base_dir, options = storage
    checkpoint = Checkpoint(open_store(base_dir, options), name)
    merged, _ = checkpoint.read_merged()
    assert merged is not None
    assert merged.height == merged["ticket_id"].n_unique() == len(expected_ids)
    assert sorted(merged["ticket_id"].to_list()) == expected_ids
    assert merged["_error"].null_count() == merged.height
    wrong = merged.filter(
        pl.col("answer") != pl.col("ticket_id").map_elements(kill_child.value, pl.String)
    )
    assert wrong.is_empty(), wrong.head()
    assert checkpoint.list_parts() == ([], [])
    options_args = [arg for k, v in options.items() for arg in ("-o", f"{k}={json.dumps(v)}")]
    assert cli(["verify", base_dir, name, *options_args]) == 0  # what it found: captured stdout

    # What each kill made later runs pay for again.
    last_run: dict[int, int] = {}
    for label, ids in calls:
        for i in ids:
            last_run[i] = max(last_run.get(i, 0), label)
    seen: set[tuple[int, int]] = set()
    per_point: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    bound_rows = bound_calls = 0
    for label, record in enumerate(report, start=1):
        cycle = record["cycle"]
        made = [ids for run, ids in calls if run == label]
        for ids in made:
            for i in ids:
                assert (label, i) not in seen, f"id {i} computed twice in run {label}"
                seen.add((label, i))
        lost_calls = [ids for ids in made if any(last_run[i] > label for i in ids)]
        lost_rows = sum(len(ids) for ids in lost_calls)
        bound = kill_child.settings_of(cycle).loss_bound()  # min_flush_seconds is 0
        rows, n_calls = bound.rows, bound.calls
        where = f"seed {SEED}, run {label}: {cycle}"
        if not record["killed"]:
            assert lost_rows == 0, where
            continue
        stats = per_point[cycle["point"]]
        stats["kills"] += 1
        stats["rows_paid_again"] += lost_rows
        stats["calls_paid_again"] += len(lost_calls)
        stats["ms"] += int(1000 * record["seconds"])
        bound_rows += rows
        bound_calls += n_calls
        assert lost_rows <= rows and len(lost_calls) <= n_calls, (lost_rows, rows, where)
        if cycle["point"] in NOTHING_LOST:
            assert lost_rows == 0, where
    total_rows = sum(len(ids) for _, ids in calls)
    assert total_rows == len(expected_ids) + sum(s["rows_paid_again"] for s in per_point.values())
    assert total_rows <= len(expected_ids) + bound_rows
    figures = {
        "kills": kills,
        "runs": len(report),
        "rows_checked": len(expected_ids),
        "calls_made": len(calls),
        "rows_computed": total_rows,
        "rows_paid_again": total_rows - len(expected_ids),
        "rows_bound": bound_rows,
        "calls_bound": bound_calls,
        "per_point": {k: dict(v) for k, v in sorted(per_point.items())},
        "seconds": round(sum(r["seconds"] for r in report), 1),
    }
    print(json.dumps(figures))
    return figures


def test_a_hundred_kills_at_the_worst_moments_lose_nothing(
    storage: Storage, tmp_path: Path
) -> None:
    kills = S3_KILLS if storage[0].startswith("s3://") else KILLS
    report, calls, spec = drive(storage, tmp_path, kills, dagster=False)

    ids = list(range(spec["final"]["rows"]))
    figures = check(storage, report, calls, kill_child.ENGINE_CHECKPOINT, ids, kills)
    if kills >= 3 * len(kill_child.POINTS):
        assert set(figures["per_point"]) == set(kill_child.POINTS)


@pytest.mark.slow
def test_kills_during_dagster_materialize_of_a_shard_lose_nothing(
    storage: Storage, tmp_path: Path
) -> None:
    report, calls, spec = drive(storage, tmp_path, DAGSTER_KILLS, dagster=True)

    partition = spec["partition"]
    rows = kill_child.source(spec["final"]["rows"])
    expected = sorted(ids_in_shard(rows, 1, kill_child.SHARDS))
    name = checkpoint_name([kill_child.ASSET], None, partition)
    check(storage, report, calls, name, expected, DAGSTER_KILLS)
