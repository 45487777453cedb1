"""Where checkpoints go: a default base_dir that would vanish with a temporary Dagster home is
refused, and a base_dir that cannot be written fails with a StorageError that says why.

Through `dagster asset materialize` (the CLI's temporary home) in ``e2e/test_home.py``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from checkpoint_assets import CheckpointIOManager, checkpointed_asset


@dg.asset
def rows() -> pl.DataFrame:
    return pl.DataFrame({"id": [1, 2, 3], "text": ["a", "b", "c"]})


@checkpointed_asset(source=rows, id_column="id")
def upper(batch: pl.DataFrame) -> pl.DataFrame:
    return batch.select("id", up=pl.col("text").str.to_uppercase())


def run(
    io_manager: CheckpointIOManager, instance: dg.DagsterInstance | None = None
) -> tuple[dg.ExecuteInProcessResult, str]:
    """Materialize both assets; the failure's error (class and message), or ''."""
    result = dg.materialize(
        [rows, upper],
        resources={"io_manager": io_manager},
        instance=instance,
        raise_on_error=False,
    )
    # A step's failure, or the IO manager's own (resource init) failure.
    errors = [
        e.event_specific_data.error  # type: ignore[union-attr]
        for e in result.all_events
        if e.is_step_failure or e.event_type_value == "RESOURCE_INIT_FAILURE"
    ]
    if not errors:
        return result, ""
    error = errors[0]
    assert error is not None
    while error.cause is not None and error.cls_name.startswith("Dagster"):  # to our error
        error = error.cause
    message = error.message.strip()
    message = message.split(": ", 1)[1] if message.startswith("checkpoint_assets.") else message
    return result, f"{error.cls_name}: {message}"


# -- the default base_dir ----------------------------------------------------------------------
def test_an_ephemeral_instance_without_base_dir_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.chdir(tmp_path)

    result, error = run(CheckpointIOManager())  # materialize() makes an ephemeral instance

    assert not result.success
    assert error.startswith("CheckpointError: CheckpointIOManager has no base_dir")
    assert "ephemeral" in error and "would be deleted after the run" in error
    assert "Set DAGSTER_HOME to an existing folder" in error and "base_dir=" in error
    assert list(tmp_path.iterdir()) == []  # nothing written (not even ./.checkpoints)


def test_a_temporary_dagster_home_without_base_dir_is_refused() -> None:
    # instance_for_test() points DAGSTER_HOME at a folder it deletes afterwards.
    with dg.instance_for_test() as instance:
        result, error = run(CheckpointIOManager(), instance)
        home = os.environ["DAGSTER_HOME"]

        assert not result.success
        assert f"DAGSTER_HOME is the temporary folder {home}" in error
        assert not os.path.exists(os.path.join(home, "checkpoints"))


def test_a_lasting_home_or_an_explicit_base_dir_works_with_any_instance(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    assert run(CheckpointIOManager())[0].success
    assert (home / "checkpoints" / "upper" / "default" / "all.parquet").exists()

    monkeypatch.delenv("DAGSTER_HOME")
    base_dir = tmp_path / "explicit"
    assert run(CheckpointIOManager(base_dir=str(base_dir)))[0].success  # ephemeral instance
    assert (base_dir / "upper" / "default" / "all.parquet").exists()


# -- a base_dir that cannot be written ---------------------------------------------------------
def test_a_base_dir_that_is_a_file_is_a_storage_error(tmp_path: Path) -> None:
    file = tmp_path / "checkpoints"
    file.write_text("not a folder")

    _, error = run(CheckpointIOManager(base_dir=str(file)))

    assert error.startswith("StorageError: ")
    assert f"{file} is a file, not a folder" in error
    assert "Point base_dir at a folder" in error
    assert file.read_text() == "not a folder"


def test_a_base_dir_below_a_file_is_a_storage_error(tmp_path: Path) -> None:
    file = tmp_path / "data"
    file.write_text("x")

    _, error = run(CheckpointIOManager(base_dir=str(file / "checkpoints")))

    assert error.startswith("StorageError: ")
    assert f"{file} is a file, not a folder" in error


# /proc refuses new files and folders to every process, root too (CI runs as root, where folder
# permissions do not stop writes). The kernel answers ENOENT there, never "no such folder".
needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")


@needs_proc
def test_a_base_dir_the_os_cannot_create_names_the_folder_the_reason_and_the_fix() -> None:
    base_dir = f"/proc/ck-{os.getpid()}"

    _, error = run(CheckpointIOManager(base_dir=base_dir))

    assert error.startswith("StorageError: ")
    assert f"while creating the folder {base_dir}: " in error
    assert f"refused to create the folder {base_dir} in /proc" in error
    assert "ENOENT No such file or directory" in error
    assert "Point base_dir at a folder on a writable disk" in error
    assert "Stored work is unchanged" in error
    assert not os.path.exists(base_dir)


@needs_proc
def test_an_existing_folder_the_os_does_not_write_names_it_the_reason_and_the_fix() -> None:
    before = set(os.listdir("/proc/self"))

    _, error = run(CheckpointIOManager(base_dir="/proc/self"))

    assert error.startswith("StorageError: ")
    assert "while writing /proc/self/rows.parquet: " in error
    assert "refused to create a file in /proc/self" in error
    assert "Point base_dir at a folder on a writable disk" in error
    assert set(os.listdir("/proc/self")) == before


@contextlib.contextmanager
def read_only_mount(folder: Path) -> Iterator[Path]:
    """``folder`` mounted read-only at a sibling path (needs root: a bind mount)."""
    target = folder.with_name(folder.name + "-ro")
    target.mkdir()
    done = subprocess.run(
        ["mount", "--bind", "-o", "ro", str(folder), str(target)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount read-only here: {done.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount needs root")
def test_a_read_only_file_system_is_a_storage_error(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    folder.mkdir()
    with read_only_mount(folder) as read_only:
        _, error = run(CheckpointIOManager(base_dir=str(read_only / "checkpoints")))

    assert error.startswith("StorageError: ")
    assert "the file system is read-only" in error and "writable base_dir" in error
    assert list(folder.iterdir()) == []


# What lets root write through any folder permission; without them root is refused like anyone.
# (Dropping to `nobody` instead fails here: the interpreter may live under /root, mode 0700.)
DAC_CAPABILITIES = "-dac_override,-dac_read_search"


def unprivileged_error(base_dir: str) -> str:
    """The error of ``run`` with ``base_dir``, as a process that folder permissions bind: this
    one, or, when it is root (as in CI), a child process running this file without the
    capabilities that override them (``setpriv``, from util-linux)."""
    if os.geteuid() != 0:
        return run(CheckpointIOManager(base_dir=base_dir))[1]
    done = subprocess.run(
        ["setpriv", f"--bounding-set={DAC_CAPABILITIES}", "--", sys.executable, __file__, base_dir],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return str(json.loads(done.stdout.splitlines()[-1]))


def test_a_folder_without_write_permission_is_a_storage_error(tmp_path: Path) -> None:
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        error = unprivileged_error(str(folder / "checkpoints"))
    finally:
        folder.chmod(0o755)

    assert error.startswith("StorageError: ")
    assert "permission denied" in error and "write access" in error


if __name__ == "__main__":  # the child of unprivileged_error: the error, as JSON on the last line
    print(json.dumps(run(CheckpointIOManager(base_dir=sys.argv[1]))[1]))
