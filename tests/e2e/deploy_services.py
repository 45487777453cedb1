"""Real services on 127.0.0.1 for the deployment tests: a PostgreSQL server in a fresh data
folder, a local Ray head, and `dagster dev`. Each is a context manager that stops exactly the
processes it started (never by name: other Ray clusters or Postgres servers on the machine are
left alone), also when the test fails half-way.

A missing piece skips the test locally with the reason and how to install it; in CI
(``CI=true``) it fails instead, so the end-to-end test never silently stops running there.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = str(Path(sys.executable).parent)


def unavailable(reason: str) -> None:
    """Skip with ``reason`` locally; fail in CI, where everything must be installed."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI must install it: see .ci/run)")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_processes(processes: list[psutil.Process], grace: float = 10.0) -> None:
    """SIGTERM the given processes, SIGKILL whichever is still alive after ``grace`` seconds."""
    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _postgres_bindir() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    # Debian's postgresql package keeps the server binaries out of PATH.
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3])
    )
    return Path(versions[-1]).parent if versions else None


@contextlib.contextmanager
def postgres_server() -> Iterator[dict[str, str]]:
    """A PostgreSQL server on 127.0.0.1 with a user and database ``dagster`` (password
    authentication). Yields the ``DAGSTER_PG_*`` variables that deploy/*'s dagster.yaml reads."""
    bindir = _postgres_bindir()
    if bindir is None:
        unavailable("PostgreSQL server binaries not found (apt-get install postgresql)")
        raise AssertionError  # unreachable: unavailable() skips or fails
    as_user: list[str] = []
    # Postgres refuses to run as root: run it as the package's `postgres` user.
    folder = Path(tempfile.mkdtemp(prefix="pg-"))
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(folder, "postgres")
    password = f"pg-{uuid.uuid4().hex}"  # unique, so a test can look for it in job specs
    (folder / "password").write_text(password)
    if as_user:
        shutil.chown(folder / "password", "postgres")
    data = folder / "data"
    port = free_port()
    subprocess.run(
        [
            *as_user,
            str(bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            "dagster",
            "--auth=scram-sha-256",
            f"--pwfile={folder / 'password'}",
            "--encoding=UTF8",
            "--no-sync",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off"
    started = subprocess.run(
        [
            *as_user,
            str(bindir / "pg_ctl"),
            *("-D", str(data), "-l", str(folder / "log"), "-o", options),
            *("-w", "-t", "60", "start"),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        env = {
            "DAGSTER_PG_HOST": "127.0.0.1",
            "DAGSTER_PG_PORT": str(port),
            "DAGSTER_PG_USER": "dagster",
            "DAGSTER_PG_PASSWORD": password,
            "DAGSTER_PG_DB": "dagster",
        }
        subprocess.run(
            [
                str(bindir / "createdb"),
                *("-h", "127.0.0.1", "-p", str(port)),
                "-U",
                "dagster",
                "dagster",
            ],
            env={**os.environ, "PGPASSWORD": password},
            check=True,
            capture_output=True,
            timeout=60,
        )
        yield env
    finally:
        subprocess.run(
            [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
            capture_output=True,
            timeout=60,
        )
        pidfile = data / "postmaster.pid"
        if pidfile.exists():  # pg_ctl could not stop it: kill the postmaster we started
            with contextlib.suppress(ValueError, psutil.Error):
                stop_processes(_tree(int(pidfile.read_text().split()[0])), grace=5)
        shutil.rmtree(folder, ignore_errors=True)


class RayHead:
    """A Ray head being started: its dashboard ``address`` (what ``RAY_ADDRESS`` names) is known
    at once; ``wait()`` returns when its job API answers."""

    def __init__(self, address: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.address, self._process, self._log = address, process, log

    def wait(self, timeout: float = 120) -> None:
        from ray.job_submission import JobSubmissionClient

        deadline = time.monotonic() + timeout
        while True:
            try:
                JobSubmissionClient(self.address).list_jobs()
                return
            except Exception:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("Ray head did not start:\n" + _tail(self._log))
                time.sleep(1)


@contextlib.contextmanager
def ray_head(env: dict[str, str], num_cpus: int = 2) -> Iterator[RayHead]:
    """A local Ray head with ``num_cpus`` CPUs, its dashboard (job API) on a free port of
    127.0.0.1, yielded as soon as it is started (other services can start meanwhile).

    ``env`` is the cluster's environment: every Ray job (and so every Dagster run) starts with
    it. The project's venv comes first on PATH, so a job finds ``dagster``. Ray starts in its
    own temp dir, outside the repository: a job finds code only through its runtime_env or
    ``env``.
    """
    try:
        import ray.job_submission  # noqa: F401 - RayHead.wait uses it
    except ImportError:
        unavailable('Ray is not installed (pip install -e ".[ray]")')
        raise
    # A short private temp dir: Ray's socket paths must stay under 108 characters, and all of
    # this cluster's processes name it on their command line, which finds stragglers below.
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    dashboard = free_port()
    cluster_env = {
        **env,
        "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        # Ray turns on token authentication when ~/.ray/auth_token exists; this cluster is
        # local to the test.
        "RAY_AUTH_MODE": "disabled",
    }
    # Ray writes it unbuffered; RayHead.wait reads it when Ray does not start.
    log = open(temp / "ray-start.log", "wb", buffering=0)  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [
            os.path.join(VENV_BIN, "ray"),
            "start",
            "--head",
            "--block",
            f"--num-cpus={num_cpus}",
            "--disable-usage-stats",
            "--include-dashboard=true",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            f"--port={free_port()}",
            f"--dashboard-port={dashboard}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--temp-dir={temp}",
        ],
        env=cluster_env,
        cwd=temp,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield RayHead(f"http://127.0.0.1:{dashboard}", process, temp / "ray-start.log")
    finally:
        ours = _tree(process.pid)
        # `ray start --block` stops its cluster on SIGTERM; whatever outlives that (workers,
        # job drivers in their own sessions) is killed by pid.
        stop_processes(ours[:1], grace=20)
        stop_processes(ours[1:] + _named(str(temp)), grace=5)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _named(marker: str) -> list[psutil.Process]:
    """Processes whose command line contains ``marker`` (a temp dir unique to this test)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(marker in part for part in p.info["cmdline"] or ()):
                found.append(p)
    return found


@contextlib.contextmanager
def dagster_dev(
    env: dict[str, str], log_path: Path, workspace: Path = ROOT / "workspace.yaml"
) -> Iterator[int]:
    """`dagster dev` (webserver, daemon, code server) for ``workspace`` (the repository's
    workspace.yaml by default) on a free port; yields the port once the webserver answers.
    Stops its whole process group."""
    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "dagster", "dev", "-w", str(workspace)),
            *("-h", "127.0.0.1", "-p", str(port)),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail("dagster dev did not start:\n" + _tail(log_path))
                time.sleep(1)
        yield port
    finally:
        ours = _tree(process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        stop_processes(ours[1:], grace=5)
        log.close()


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"({path} unreadable: {e})"
