"""Credentials never show: not in run logs, metadata, errors, nor the operator CLI's output.

Runs use distinctive fake credentials (moto's server accepts any) in ``storage_options``, in the
environment through ``{"env": "VAR"}``, and in URIs; then every text a user or a log collector
can see is searched for them: the run's whole event log (failures carry the error and its
causes), the materialization metadata, the run record, the raised error with its causes, what
the process printed, and the output of ``checkpoint-assets status`` / ``inspect`` / ``verify``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._serdes import serialize_value
from dagster_aws.s3 import S3Resource
from helpers.jobs import ASSET, build_job, tickets

from checkpoint_assets import CheckpointError, CheckpointIOManager

KEY_ID = "AKIDFUZZQ7X3K2LEAKCHECK"
SECRET = "sEcReT-fuzz-9f8e7d6c5b4a-do-not-log"
ENV_SECRET = "eNvSeCrEt-fuzz-1a2b3c4d5e6f-do-not-log"
CREDENTIALS = (KEY_ID, SECRET, ENV_SECRET)
NewStorage = Callable[[], tuple[str, dict[str, Any]]]


def _options(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {
        "key": KEY_ID,
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}},  # fail fast
        **extra,
    }


def _closed_port() -> int:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _run_texts(instance: dg.DagsterInstance) -> list[str]:
    """Every event of every run, and every run record, as stored (serialized)."""
    texts = []
    for record in instance.get_run_records():
        texts.append(serialize_value(record.dagster_run))
        texts.extend(serialize_value(e) for e in instance.all_logs(record.dagster_run.run_id))
    return texts


def assert_hidden(*texts: str) -> None:
    for text in texts:
        for credential in CREDENTIALS:
            assert credential not in text, f"a credential shows in: {text[:2000]}"


def _materialize(job: Any) -> tuple[dg.ExecuteInProcessResult | None, BaseException | None]:
    try:
        return job.materialize(), None
    except Exception as e:
        return None, e


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("checkpoint-assets")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "checkpoint_assets.cli"]
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_a_run_on_s3_shows_its_credentials_nowhere(
    new_s3_storage: NewStorage,
    s3_server: str,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    base_dir, _ = new_s3_storage()
    monkeypatch.setenv("FUZZ_CKPT_SECRET", ENV_SECRET)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)  # the environment chain's
    options = _options(s3_server, secret={"env": "FUZZ_CKPT_SECRET"})
    job = build_job((base_dir, options), tickets(20))

    first = job.materialize()
    job.materialize()  # a resume too

    metadata = first.asset_materializations_for_node(ASSET)[0].metadata
    texts = _run_texts(job.instance)
    bucket = base_dir.removeprefix("s3://").split("/")[0]
    assert any(bucket in t for t in texts), "the search must see the runs' metadata"
    assert_hidden(repr(metadata), *texts, *capfd.readouterr())
    cli_options = ["-o", f"key={KEY_ID}", "-o", f"secret={SECRET}"]
    cli_options += ["-o", f'client_kwargs={{"endpoint_url": "{s3_server}"}}']
    for command in (["status"], ["inspect", base_dir, f"{ASSET}/default/all"], ["verify"]):
        args = [command[0], *(command[1:] or [base_dir]), *cli_options]
        out = _cli(*args, env={"AWS_SECRET_ACCESS_KEY": ENV_SECRET})
        assert out.returncode == 0, out.stderr
        assert f"{ASSET}" in out.stdout + out.stderr  # it did list the checkpoint
        assert_hidden(out.stdout, out.stderr)


def _storage_failures(s3_server: str, bucket_dir: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """Storage settings that fail, each with the secret in its options."""
    closed = f"http://127.0.0.1:{_closed_port()}"
    return {
        "missing-bucket": (
            f"s3://no-such-{uuid.uuid4().hex[:10]}/checkpoints",
            _options(s3_server),
        ),
        "unreachable-endpoint": (bucket_dir, _options(closed)),
        "endpoint-with-userinfo": (
            bucket_dir,
            _options(f"http://{KEY_ID}:{SECRET}@{s3_server.removeprefix('http://')}"),
        ),
        "unreachable-endpoint-with-userinfo": (
            bucket_dir,
            _options(f"http://{KEY_ID}:{SECRET}@{closed.removeprefix('http://')}"),
        ),
        "unknown-option": (bucket_dir, _options(s3_server, sekret=SECRET)),
        "malformed-option": (bucket_dir, _options(s3_server, config_kwargs={"retries": SECRET})),
    }


FAILURES = [
    "missing-bucket",
    "unreachable-endpoint",
    "endpoint-with-userinfo",
    "unreachable-endpoint-with-userinfo",
    "unknown-option",
    "malformed-option",
]


@pytest.mark.parametrize("case", FAILURES)
def test_a_storage_failure_shows_no_credentials(
    case: str,
    new_s3_storage: NewStorage,
    s3_server: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    base_dir, _ = new_s3_storage()
    storage = _storage_failures(s3_server, base_dir)[case]
    job = build_job(storage, tickets(5), max_attempts=1)

    result, error = _materialize(job)

    assert result is None and error is not None, "the run must fail"
    assert job.calls == [], "a storage failure must stop the run before any call"
    assert_hidden(*(f"{type(e).__name__}: {e}" for e in _chain(error)))
    texts = _run_texts(job.instance)
    assert any(type(error).__name__ in t for t in texts), "the search must see the failure"
    assert_hidden(*texts, *capfd.readouterr())


@pytest.mark.parametrize("case", ["missing-bucket", "unreachable-endpoint"])
def test_the_cli_on_failing_storage_shows_no_credentials(
    case: str, new_s3_storage: NewStorage, s3_server: str
) -> None:
    base_dir, _ = new_s3_storage()
    url, options = _storage_failures(s3_server, base_dir)[case]
    endpoint = options["client_kwargs"]["endpoint_url"]

    out = _cli(
        "status",
        url,
        "-o",
        f"key={KEY_ID}",
        "-o",
        f"secret={SECRET}",
        "-o",
        f'client_kwargs={{"endpoint_url": "{endpoint}"}}',
        "-o",
        'config_kwargs={"retries": {"max_attempts": 1}}',
    )

    assert out.returncode != 0
    assert "error:" in out.stderr
    assert_hidden(out.stdout, out.stderr)


@pytest.mark.parametrize(
    "case, says",
    [
        pytest.param("endpoint-with-userinfo", "endpoint"),
        pytest.param("unknown-option", "sekret"),
    ],
)
def test_bad_storage_settings_are_refused_with_a_clear_error(
    case: str, says: str, new_s3_storage: NewStorage, s3_server: str
) -> None:
    base_dir, _ = new_s3_storage()
    storage = _storage_failures(s3_server, base_dir)[case]
    job = build_job(storage, tickets(5))

    _result, error = _materialize(job)

    assert isinstance(error, CheckpointError), repr(error)
    assert says in str(error)
    assert_hidden(*(f"{type(e).__name__}: {e}" for e in _chain(error)))


def test_credentials_inside_base_dir_are_refused_without_being_echoed(
    new_s3_storage: NewStorage, s3_server: str, capfd: pytest.CaptureFixture[str]
) -> None:
    base_dir, _ = new_s3_storage()
    bucket_dir = base_dir.removeprefix("s3://")
    options = {"client_kwargs": {"endpoint_url": s3_server, "region_name": "us-east-1"}}
    job = build_job((f"s3://{KEY_ID}:{SECRET}@{bucket_dir}", options), tickets(5))

    _result, error = _materialize(job)

    assert isinstance(error, CheckpointError), repr(error)
    assert "storage_options" in str(error)  # says where credentials belong
    assert_hidden(*(f"{type(e).__name__}: {e}" for e in _chain(error)))
    assert_hidden(*_run_texts(job.instance), *capfd.readouterr())


def test_a_mistyped_cli_option_does_not_echo_its_value(tmp_path: Path) -> None:
    out = _cli("status", str(tmp_path), "-o", f"secret:{SECRET}")

    assert out.returncode == 2
    assert "key=value" in out.stderr
    assert_hidden(out.stdout, out.stderr)


def test_the_keys_of_an_s3_resource_show_nowhere(
    new_s3_storage: NewStorage, s3_server: str, capfd: pytest.CaptureFixture[str]
) -> None:
    base_dir, _ = new_s3_storage()
    s3 = S3Resource(
        endpoint_url=s3_server,
        region_name="us-east-1",
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
    )
    job = build_job((base_dir, {}), tickets(8))
    resources = {
        "io_manager": CheckpointIOManager(base_dir=base_dir, s3_resource=s3),
        "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
    }

    result = dg.materialize([job.source, job.asset], resources=resources, instance=job.instance)

    metadata = result.asset_materializations_for_node(ASSET)[0].metadata
    assert metadata["rows_computed"].value == 8
    assert_hidden(repr(metadata), *_run_texts(job.instance), *capfd.readouterr())
