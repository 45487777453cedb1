"""The `checkpoint-assets` operator CLI, run as users run it: its console script, in a subprocess,
on checkpoints made by real runs: finished, with failed rows (tolerated or not), held by a live
writer, and left as parts by a run killed with SIGKILL. What a test reads only to compare with
(the counts before and after a command) comes from `status --json` in this process. The live
writer is this process too: a lease with its heartbeat, held while the CLI's process runs."""

from __future__ import annotations

import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from click.testing import CliRunner
from helpers.jobs import build_job, tickets

from checkpoint_assets import shard_partitions
from checkpoint_assets.cli import cli as cli_group
from checkpoint_assets.engine.checkpoints.layout import part_range
from checkpoint_assets.engine.loop.lock import Lease
from checkpoint_assets.engine.storage import open_store

TESTS = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "checkpoint-assets")
CRASH_CHILD = TESTS / "helpers" / "crash_child.py"

LOCKED = "routed/scratch/1-of-2"
KILLED = "killed/routed/default/all"  # crash_child's checkpoint, under a base_dir one level down
REFUSED = {3: "model refused [policy]", 7: "model refused [policy]", 11: "model refused [policy]"}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=env,
        timeout=120,
    )


def status_json(base: str, *options: str) -> dict[str, dict[str, Any]]:
    done = cli("status", base, "--json", *options)
    assert done.returncode == 0, done.stderr
    return {f"{c['asset']}/{c['tag']}/{c['partition']}": c for c in json.loads(done.stdout)}


def stored(base: Path) -> dict[str, dict[str, Any]]:
    """`status --json` run in this process: what a test compares a command's effect with."""
    done = CliRunner().invoke(cli_group, ["status", str(base), "--json"])
    assert done.exit_code == 0, done.output
    return {f"{c['asset']}/{c['tag']}/{c['partition']}": c for c in json.loads(done.stdout)}


def table(out: str) -> dict[str, dict[str, str]]:
    """The rows of the `status` table by checkpoint name, cut at the header's column starts."""
    header, *lines = out.strip("\n").splitlines()
    names = ["asset", "tag", "partition", "rows ok", "rows failed", "parts", "size"]
    names += ["last write", "lock"]
    starts = [header.index(n) for n in names]
    rows = {}
    for line in lines:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        row = dict(zip(names, cells, strict=True))
        rows[f"{row['asset']}/{row['tag']}/{row['partition']}"] = row
    return rows


def files_of(base: Path, name: str) -> set[Path]:
    merged = base / f"{name}.parquet"
    return {p for p in merged.parent.rglob("*") if p.is_file() and str(p).startswith(str(merged))}


@contextmanager
def holding(base: Path, name: str, run_id: str) -> Iterator[None]:
    """A live writer holds the lock of checkpoint ``name``: this process, as run ``run_id``."""
    store = open_store(str(base))
    lease = Lease(store, store.path(f"{name}.parquet.lock"), run_id=run_id, lease_seconds=60.0)
    lease.acquire()
    try:
        yield
    finally:
        lease.release()


def refuse(batch: pl.DataFrame) -> pl.DataFrame:
    """Routes tickets, failing the ids of ``REFUSED`` (each alone, by poison-row isolation)
    and ticket 5 with a different error."""
    ids = set(batch.get_column("ticket_id").to_list())
    if ids & set(REFUSED):
        raise ValueError("model refused [policy]")
    if 5 in ids:
        raise TimeoutError("no answer in 30 s")
    return batch.select("ticket_id", route=pl.col("body").str.to_uppercase())


def kill_mid_run(base: Path, tmp: Path) -> None:
    """A run killed with SIGKILL after some flushes: parts, a meta without counts, a dead lock."""
    spec = {
        "mode": "engine",
        "base_dir": str(base / "killed"),
        "options": {},
        "rows": 400,
        "interval": 4,
        "delay": 0.02,
        "flush_seconds": 30.0,
        "min_flush_seconds": 0.0,
        "log": str(tmp / "computed.log"),
        "run": 1,
        "report": str(tmp / "report.json"),
    }
    child = subprocess.Popen([sys.executable, str(CRASH_CHILD), json.dumps(spec)])
    deadline = time.monotonic() + 60
    log = tmp / "computed.log"
    while not log.exists() or len(log.read_text().splitlines()) < 40:
        assert child.poll() is None and time.monotonic() < deadline, "the run did not progress"
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A base_dir holding checkpoints of every kind; ``LOCKED`` is held by a live writer."""
    tmp = tmp_path_factory.mktemp("cli")
    base = tmp / "checkpoints"
    storage = (str(base), {})
    build_job(storage, tickets(20)).materialize()
    tolerant = build_job(storage, tickets(20), fn=refuse, max_failed_fraction=0.5)
    assert tolerant.materialize(checkpoint_tag="flaky").success
    strict = build_job(storage, tickets(20), fn=refuse)
    assert not strict.materialize(checkpoint_tag="strict", raise_on_error=False).success
    sharded = build_job(storage, tickets(40), partitions_def=shard_partitions(2))
    for key in ("0-of-2", "1-of-2"):
        sharded.materialize(key, checkpoint_tag="scratch")
    kill_mid_run(base, tmp)
    with holding(base, LOCKED, "run-that-holds"):
        yield base


@pytest.fixture
def copy_of(world: Path, tmp_path: Path) -> Callable[[], Path]:
    """A copy of ``world`` that a test may change, without the live writer's lock."""

    def make() -> Path:
        copy = Path(shutil.copytree(world, tmp_path / "copy"))
        (copy / f"{LOCKED}.parquet.lock").unlink()
        return copy

    return make


def test_status_counts_rows_of_finished_failed_locked_and_interrupted_checkpoints(
    world: Path,
) -> None:
    # (a part being written when the run was killed is a temporary file, not a part)
    parts = list((world / f"{KILLED}.parquet.parts").glob("part-*.parquet"))
    killed_ids = pl.concat([pl.read_parquet(p) for p in parts]).get_column("ticket_id")
    assert not (world / f"{KILLED}.parquet").exists()  # killed before its first finalize

    listed = status_json(str(world))
    counts = {name: (c["rows_ok"], c["rows_failed"], c["parts"]) for name, c in listed.items()}
    assert counts == {
        "routed/default/all": (20, 0, 0),
        "routed/flaky/all": (16, 4, 0),
        "routed/strict/all": (16, 4, 0),
        "routed/scratch/0-of-2": (counts["routed/scratch/0-of-2"][0], 0, 0),
        "routed/scratch/1-of-2": (40 - counts["routed/scratch/0-of-2"][0], 0, 0),
        KILLED: (killed_ids.n_unique(), 0, len(parts)),
    }
    assert 0 < killed_ids.n_unique() < 400 and counts[KILLED][2] > 1

    locked = listed[LOCKED]
    assert locked["lock"].startswith("run run-that-holds, host ") and locked["lock_stale"] is None
    assert listed[KILLED]["lock"] is not None  # the killed run's lock, left behind...
    assert "is gone" in listed[KILLED]["lock_stale"]  # ...and known to be dead
    assert listed["routed/default/all"]["lock"] is None
    for name, c in listed.items():
        if name == LOCKED:
            continue  # its holder's heartbeat may rewrite the lock file meanwhile
        files = files_of(world, name)
        assert c["bytes"] == sum(p.stat().st_size for p in files)
        newest = max(p.stat().st_mtime for p in files)
        assert datetime.fromisoformat(c["last_write"]) == datetime.fromtimestamp(int(newest), UTC)

    shown = cli("status", str(world))
    assert shown.returncode == 0, shown.stderr
    rows = table(shown.stdout)
    assert set(rows) == set(listed)
    assert [rows["routed/flaky/all"][k] for k in ("rows ok", "rows failed", "parts")] == [
        "16",
        "4",
        "0",
    ]
    assert rows[KILLED]["rows ok"] == str(killed_ids.n_unique())
    assert rows[LOCKED]["lock"] == locked["lock"]
    assert rows[KILLED]["lock"].endswith(f"(stale: {listed[KILLED]['lock_stale']})")


def test_status_defaults_to_dagster_home_and_says_what_to_give(world: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "checkpoints").symlink_to(world)
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    found = cli("status", "--json", env=env)
    assert found.returncode == 0, found.stderr
    assert len(json.loads(found.stdout)) == 6

    env.pop("DAGSTER_HOME")
    missing = cli("status", env=env)
    assert missing.returncode == 2
    assert "Give BASE_DIR" in missing.stderr and "DAGSTER_HOME" in missing.stderr
    assert "Traceback" not in missing.stderr

    bad = cli("status", str(world), "-o", "no-equals-sign")
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr


def test_inspect_shows_the_most_common_errors_and_lists_failed_ids(world: Path) -> None:
    shown = cli("inspect", str(world), "routed/flaky/all")
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "16 ok, 4 failed" in out and "ticket_id" in out and "route" in out
    errors = out[out.index("most common errors") : out.index("sample rows")].splitlines()
    refused = next(line for line in errors if "model refused [policy]" in line)
    assert refused.split()[0] == "3" and refused.rstrip().endswith("3, 7, 11")
    timeout = next(line for line in errors if "no answer in 30 s" in line)
    assert timeout.split()[0] == "1" and timeout.rstrip().endswith("5")
    assert errors.index(refused) < errors.index(timeout)  # the most common first

    failed = cli("inspect", str(world), "routed/strict/all", "--failed")
    assert failed.returncode == 0, failed.stderr
    assert failed.stdout == "3\n5\n7\n11\n"
    assert cli("inspect", str(world), "routed/default/all", "--failed").stdout == ""

    missing = cli("inspect", str(world), "routed/nope/all")
    assert missing.returncode == 2
    assert missing.stderr.startswith("error: No checkpoint 'routed/nope/all'")
    assert "checkpoint-assets status" in missing.stderr


def test_inspect_into_a_pipe_closed_early_prints_no_traceback(tmp_path: Path) -> None:
    # Failed ids of 3 kB each: far more than a pipe holds, so `head` leaves while ids remain.
    ids = [f"t{i:03d}-" + "x" * 3000 for i in range(200)]
    df = pl.DataFrame({"ticket_id": ids, "subject": ["s"] * 200, "body": ["b"] * 200})
    bad = set(ids[::2])

    def half(batch: pl.DataFrame) -> pl.DataFrame:
        if bad & set(batch.get_column("ticket_id").to_list()):
            raise ValueError("refused")
        return batch.select("ticket_id", route=pl.col("body"))

    base = tmp_path / "checkpoints"
    job = build_job(
        (str(base), {}), df, fn=half, checkpoint_interval=2, max_attempts=1, max_failed_fraction=1.0
    )
    assert job.materialize().success
    script = f'"{CLI}" inspect "{base}" routed/default/all --failed | head -1; '
    script += 'echo "status=${PIPESTATUS[0]}" >&2'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout == ids[0] + "\n"
    assert done.stderr == "status=141\n"  # no traceback, and the status of a tool cut short


def test_verify_flags_a_corrupted_part_and_passes_sound_checkpoints(
    copy_of: Callable[[], Path],
) -> None:
    base = copy_of()
    ok = cli("verify", str(base))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout == ""
    assert "Verified 6 checkpoint(s): 0 with problems." in ok.stderr

    parts = base / f"{KILLED}.parquet.parts"
    seq = 1 + max(r[1] for r in map(part_range, os.listdir(parts)) if r)  # no gap: the next flush
    corrupt = parts / f"part-{seq:012d}-{seq:012d}-0123ab.parquet"
    corrupt.write_bytes(b"not parquet")
    flagged = cli("verify", str(base))
    assert flagged.returncode == 1
    assert flagged.stdout.startswith(f"{KILLED}: Checkpoint file ")
    assert f"{corrupt.name} is unreadable" in flagged.stdout
    assert len(flagged.stdout.splitlines()) == 1
    assert corrupt.exists()  # verify only looks

    one = cli("verify", str(base), "routed/flaky/all")
    assert (one.returncode, one.stdout) == (0, "")
    assert cli("verify", str(base), KILLED).returncode == 1


def test_compact_merges_parts_and_skips_a_checkpoint_a_live_run_holds(
    copy_of: Callable[[], Path],
) -> None:
    base = copy_of()
    before = stored(base)[KILLED]
    with holding(base, LOCKED, "another-run"):
        done = cli("compact", str(base))
    assert done.returncode == 1  # the held one was skipped, and said so
    assert f"{LOCKED}: skipped: " in done.stderr and "another-run" in done.stderr
    assert f"{KILLED}: merged {before['parts']} part(s)" in done.stderr

    after = stored(base)[KILLED]
    assert after["parts"] == 0
    assert list((base / f"{KILLED}.parquet.parts").glob("part-*.parquet")) == []
    assert (after["rows_ok"], after["rows_failed"]) == (before["rows_ok"], 0)
    assert after["lock"] is None  # the dead run's lock was taken over, then released
    assert pl.read_parquet(base / f"{KILLED}.parquet").height == before["rows_ok"]
    assert cli("compact", str(base), LOCKED).returncode == 0  # free now


def test_compact_says_a_checkpoint_it_cannot_compact_is_an_error_and_what_to_do_not_skipped(
    copy_of: Callable[[], Path],
) -> None:
    base = copy_of()
    victim = sorted((base / f"{KILLED}.parquet.parts").glob("part-*.parquet"))[0]
    truncated = victim.read_bytes()[:40]
    victim.write_bytes(truncated)
    with holding(base, LOCKED, "another-run"):
        done = cli("compact", str(base))
    assert done.returncode == 2, done.stderr  # an error, not "skipped" (exit status 1)
    assert f"{KILLED}: error: Checkpoint file {victim} is unreadable" in done.stderr
    assert f"`checkpoint-assets repair {base} {KILLED}` does that now" in done.stderr
    assert f"{KILLED}: skipped" not in done.stderr
    assert f"{LOCKED}: skipped: " in done.stderr  # only the held one is skipped
    assert "routed/flaky/all: merged 0 part(s)" in done.stderr  # the others are compacted
    assert "; skipped 1 held by a live run; 1 failed." in done.stderr
    assert victim.read_bytes() == truncated  # compact never moves or deletes damaged files

    (base / "routed/flaky/all.parquet.meta.json").unlink()
    lost = cli("compact", str(base), "routed/flaky/all")
    assert lost.returncode == 2, lost.stderr
    assert "routed/flaky/all: error: " in lost.stderr and "Restore the meta file" in lost.stderr
    nothing = cli("compact", str(base), "routed/nope/all")
    assert nothing.returncode == 2, nothing.stderr
    assert "routed/nope/all: error: No checkpoint 'routed/nope/all'" in nothing.stderr
    assert f"`checkpoint-assets status {base}` lists the checkpoints there" in nothing.stderr

    # repair goes through the same loop: an error per checkpoint, in its JSON report too
    unknown = cli("repair", str(base), "routed/nope/all", "--json")
    assert unknown.returncode == 2, unknown.stderr
    (report,) = json.loads(unknown.stdout)
    assert report["name"] == "routed/nope/all" and report["skipped"] is None
    assert report["error"].startswith("No checkpoint 'routed/nope/all'")


def test_clean_deletes_a_tags_checkpoints_but_not_a_held_one_nor_other_tags(
    copy_of: Callable[[], Path],
) -> None:
    base = copy_of()
    everything = {p: p.read_bytes() for p in base.rglob("*") if p.is_file()}
    refused = cli("clean", str(base), "--tag", "scratch")  # stdin is not a terminal
    assert refused.returncode == 2
    assert "--yes" in refused.stderr and "Traceback" not in refused.stderr
    assert {p: p.read_bytes() for p in base.rglob("*") if p.is_file()} == everything

    gone = files_of(base, "routed/scratch/0-of-2")
    assert cli("clean", str(base), "--tag", "scratch", "--asset", "other", "--yes").returncode == 0
    with holding(base, LOCKED, "busy-run"):
        done = cli("clean", str(base), "--tag", "scratch", "--yes")
        assert (base / f"{LOCKED}.parquet.lock").exists()
    assert done.returncode == 1, done.stderr
    assert f"{LOCKED}: skipped: " in done.stderr and "busy-run" in done.stderr
    size = sum(len(everything[p]) for p in gone)
    assert done.stdout.startswith(f"Deleted 1 checkpoint(s) of tag 'scratch': {len(gone)} files")
    assert size > 0 and not any(p.exists() for p in gone)
    assert not (base / "routed" / "scratch" / "0-of-2.parquet.parts").exists()

    left = stored(base)
    assert set(left) == {
        "routed/default/all",
        "routed/flaky/all",
        "routed/strict/all",
        LOCKED,
        KILLED,
    }
    assert left[LOCKED]["rows_ok"] > 0 and left["routed/default/all"]["rows_ok"] == 20


def test_status_json_on_s3(new_s3_storage: Callable[[], tuple[str, dict[str, Any]]]) -> None:
    base_dir, options = new_s3_storage()
    build_job((base_dir, options), tickets(20)).materialize()
    tolerant = build_job((base_dir, options), tickets(20), fn=refuse, max_failed_fraction=0.5)
    assert tolerant.materialize(checkpoint_tag="flaky").success
    flags = [f"-o{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in options.items()]

    listed = status_json(base_dir, *flags)
    assert {n: (c["rows_ok"], c["rows_failed"], c["parts"]) for n, c in listed.items()} == {
        "routed/default/all": (20, 0, 0),
        "routed/flaky/all": (16, 4, 0),
    }
    assert all(c["bytes"] > 0 and c["last_write"] and c["lock"] is None for c in listed.values())


def test_clean_on_a_terminal_asks_first(copy_of: Callable[[], Path]) -> None:
    base = copy_of()
    flaky = files_of(base, "routed/flaky/all")

    def answering(answer: bytes) -> subprocess.CompletedProcess[str]:
        main, terminal = pty.openpty()  # stdin is a terminal, as for someone at a shell
        try:
            os.write(main, answer)
            return subprocess.run(
                [CLI, "clean", str(base), "--tag", "flaky"],
                stdin=terminal,
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            os.close(terminal)
            os.close(main)

    declined = answering(b"n\n")
    assert declined.returncode == 1 and "Nothing deleted." in declined.stderr
    assert "Delete 1 checkpoint(s) of tag 'flaky'" in declined.stderr
    assert all(p.exists() for p in flaky)

    accepted = answering(b"y\n")
    assert accepted.returncode == 0, accepted.stderr
    assert accepted.stdout.startswith(f"Deleted 1 checkpoint(s) of tag 'flaky': {len(flaky)} files")
    assert not any(p.exists() for p in flaky) and not (base / "routed" / "flaky").exists()
    assert (base / "routed" / "default" / "all.parquet").exists()


def test_repair_rebuilds_from_what_is_readable_keeps_damaged_files_and_skips_a_held_one(
    copy_of: Callable[[], Path],
) -> None:
    base = copy_of()
    before = stored(base)[KILLED]
    parts = sorted((base / f"{KILLED}.parquet.parts").glob("part-*.parquet"))
    bad_part = parts[0]
    lost = pl.read_parquet(bad_part).height
    bad_bytes = bad_part.read_bytes()[:40]  # truncated
    bad_part.write_bytes(bad_bytes)
    merged = base / "routed/default/all.parquet"
    merged.write_bytes(merged.read_bytes()[:-100] + b"\x00" * 100)  # garbage over the footer
    stray = bad_part.with_name(bad_part.name + ".tmp-0123456789ab")  # a killed write's, long ago
    stray.write_bytes(b"half a part")
    os.utime(stray, (time.time() - 3600, time.time() - 3600))
    damaged = stored(base)[KILLED]
    assert damaged["parts"] == len(parts)  # the temporary file is no part
    assert "is unreadable" in damaged["error"]  # status reads, it never moves anything

    with holding(base, LOCKED, "busy-run"):
        done = cli("repair", str(base))

    assert done.returncode == 1, done.stderr  # the held one was skipped, and said so
    assert f"{LOCKED}: skipped: " in done.stderr and "busy-run" in done.stderr
    quarantine = base / f"{KILLED}.parquet.quarantine"
    (kept,) = quarantine.iterdir()
    assert kept.read_bytes() == bad_bytes and kept.name.endswith(".damaged")
    assert f"{KILLED}: moved {bad_part} to {kept} (is unreadable" in done.stdout
    assert (
        f"{KILLED}: moved 1 damaged file(s) aside; merged {len(parts) - 1} part(s); removed 1 "
        f"stale temporary file(s): {before['rows_ok'] - lost:,} rows ok, 0 failed"
    ) in done.stdout
    assert f"routed/default/all: moved {merged} to " in done.stdout
    assert "routed/flaky/all: nothing to repair: 16 rows ok, 4 failed" in done.stdout
    assert not stray.exists() and not merged.exists()

    after = stored(base)
    assert (after[KILLED]["rows_ok"], after[KILLED]["parts"]) == (before["rows_ok"] - lost, 0)
    assert after["routed/default/all"]["rows_ok"] == 0  # computed again by the next run
    assert CliRunner().invoke(cli_group, ["verify", str(base)]).exit_code == 0

    (base / "routed/flaky/all.parquet.meta.json").unlink()
    lost_meta = cli("repair", str(base), "routed/flaky/all", "--json")
    assert lost_meta.returncode == 0, lost_meta.stderr
    (report,) = json.loads(lost_meta.stdout)
    assert "only record of the job" in report["meta_lost"] and report["skipped"] is None
    assert [m["path"] for m in report["moved"]] == [str(base / "routed/flaky/all.parquet")]
    assert not (base / "routed/flaky/all.parquet").exists()


@pytest.mark.parametrize("command", ["status", "verify", "inspect", "compact"])
def test_each_command_fails_on_a_folder_that_does_not_exist(tmp_path: Path, command: str) -> None:
    typo = tmp_path / "chekpoints"

    done = cli(command, str(typo), *(["routed/default/all"] if command == "inspect" else []))

    assert done.returncode == 2
    assert done.stderr.startswith(f"error: {typo} does not exist")
    assert "Check the path" in done.stderr and "Traceback" not in done.stderr
    assert not typo.exists()  # nothing made in its place
