"""Shared fixtures: every storage-facing test runs against local disk and against S3.

The S3 side talks real HTTP to moto's server mode on 127.0.0.1 (started once per session),
never an in-process mock of boto. The server counts the requests it serves per bucket
(``s3_requests``), so tests can hold the engine's own request counters to what really happened.
GCS and Azure Blob run against their emulators (``helpers/clouds.py``), started once per session
(once per xdist worker) by the tests that ask for them.

The suite runs on three pytest-xdist workers (``scripts/test``: ``-n 3 --dist loadgroup``); the
groups below keep some tests on one worker (``XDIST_GROUPS``).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Tests that one xdist worker runs, one group at a time (``GroupScheduling``):
# - "timing": outcomes that depend on real time or on a share of the CPU (throttling against real
#   threads and endpoints, kills against the documented loss bound, the benchmark smoke and its
#   endpoint scenarios). Never two of them at once, so each meets at most the other two
#   workers' load.
# - a file whose module-scoped fixture is expensive (a `dagster dev` with its daemon, a built
#   checkpoint world, a moto server with IAM, a built wheel, the built docs site) starts it once,
#   not once per worker.
# Keys: a file under tests/, or a file and a test name (all its parameters).
XDIST_GROUPS = {
    "engine/calls/test_throttle.py": "timing",
    "reliability/test_kills.py": "timing",
    "e2e/test_bench_smoke.py": "timing",
    "e2e/test_llm_openai.py::test_a_shard_killed_mid_run_resumes_without_duplicates": "timing",
    "e2e/test_rate_limits.py::test_a_first_burst_waits_for_answers_that_state_the_budget": "timing",
    "e2e/test_daemon_path.py": "daemon_path",
    "e2e/test_install.py": "install",
    "e2e/test_cli.py": "cli",
    "test_site.py": "site",
    "integration/test_s3.py": "s3",
}


def xdist_group(nodeid: str) -> str | None:
    """The group of XDIST_GROUPS that a test (by its node id) belongs to, if any."""
    where, _, name = nodeid.removeprefix("tests/").partition("::")
    return XDIST_GROUPS.get(f"{where}::{name.split('[')[0]}") or XDIST_GROUPS.get(where)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The run's order, which the workers also take their work in: first the units of work that
    hold a ``slow`` test, then the others; within each, the largest groups first (a stable sort).
    The longest tests start at once and do not form the run's tail."""
    slow = {xdist_group(i.nodeid) or i.nodeid for i in items if i.get_closest_marker("slow")}
    sizes = Counter(xdist_group(i.nodeid) for i in items)

    def rank(item: pytest.Item) -> tuple[bool, int]:
        group = xdist_group(item.nodeid)
        return (group or item.nodeid) not in slow, -sizes[group] if group else 0

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` by XDIST_GROUPS: each group goes to one worker as one unit of work, the
    other tests one by one, in the order of ``pytest_collection_modifyitems``. pytest-xdist's own
    loadgroup reads ``xdist_group`` marks, which pytest 9.2's node ids do not carry to its
    scheduler."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GroupScheduling(LoadGroupScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid) or str(super()._split_scope(nodeid))

    config.option.loadscopereorder = False  # the collection's order is the schedule
    return GroupScheduling(config, log)


class CountingMotoServer:
    """moto's S3 server on 127.0.0.1 behind a WSGI wrapper that counts requests per bucket.

    Requests are counted the way the engine names them: PUT, GET, LIST (a GET of the bucket
    itself), DELETE (DeleteObject or one DeleteObjects batch), HEAD; BUCKET PUT (creating the
    bucket); and COPY (a server-side copy) and MULTIPART (a multipart upload step), which the
    engine should never need.
    """

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        self.counts: dict[str, Counter[str]] = {}
        self.bytes_read: Counter[str] = Counter()  # bytes of successful GETs, per bucket
        self.largest: Counter[str] = Counter()  # the largest request body, per bucket
        self._lock = threading.Lock()
        self._conditional = threading.Lock()
        app = self._counting(DomainDispatcherApplication(create_backend_app))
        # What moto's ThreadedMotoServer does, with the counting wrapper around its app.
        self._server = make_server("127.0.0.1", 0, app, True, request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host!s}:{port}"

    def _counting(self, app: Any) -> Callable[[dict[str, Any], Any], Iterable[bytes]]:
        def wsgi(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "/").lstrip("/")
            bucket, _, key = path.partition("/")
            method = environ.get("REQUEST_METHOD", "GET")
            query = environ.get("QUERY_STRING", "")
            if method == "POST" and "delete" in query:
                kind = "DELETE"
            elif not key:
                kind = "LIST" if method == "GET" else f"BUCKET {method}"
            elif "uploadId" in query or "uploads" in query:
                kind = "MULTIPART"
            elif method == "PUT" and "HTTP_X_AMZ_COPY_SOURCE" in environ:
                kind = "COPY"
            else:
                kind = method
            size = int(environ.get("CONTENT_LENGTH") or 0)
            with self._lock:
                self.counts.setdefault(bucket, Counter())[kind] += 1
                self.largest[bucket] = max(self.largest[bucket], size)
            status: list[str] = []

            def respond(code: str, *args: Any) -> Any:
                status.append(code)
                return start_response(code, *args)

            if "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ:
                # S3 makes a conditional write atomic; moto checks, then stores, unlocked, so
                # two racing writers could both win. One at a time here, as on S3.
                with self._conditional:
                    body = app(environ, respond)
            else:
                body = app(environ, respond)
            if kind != "GET":
                return body  # type: ignore[no-any-return]
            return self._sent(bucket, body, status)

        return wsgi

    def _sent(self, bucket: str, body: Iterable[bytes], status: list[str]) -> Iterator[bytes]:
        """``body``, its bytes counted as read when the GET succeeded (2xx)."""
        for chunk in body:
            if status and status[0].startswith("2"):
                with self._lock:
                    self.bytes_read[bucket] += len(chunk)
            yield chunk

    def requests(self, bucket: str) -> Counter[str]:
        """Requests served for ``bucket`` so far, by kind."""
        with self._lock:
            return Counter(self.counts.get(bucket, Counter()))

    def sent(self, bucket: str) -> int:
        """Bytes of the successful GETs of ``bucket`` so far (what clients read)."""
        with self._lock:
            return self.bytes_read[bucket]

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[CountingMotoServer]:
    """The session's moto S3 server (see ``CountingMotoServer``)."""
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    server = CountingMotoServer()
    try:
        yield server
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)


@pytest.fixture(scope="session")
def s3_server(moto_s3: CountingMotoServer) -> str:
    """The endpoint URL of a moto S3 server on 127.0.0.1."""
    return moto_s3.endpoint


def s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def make_bucket(endpoint: str) -> str:
    """Create a fresh, empty bucket on the moto server; returns its name."""
    import boto3

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)
    return bucket


@pytest.fixture
def new_s3_storage(s3_server: str) -> Callable[[], tuple[str, dict[str, Any]]]:
    """A factory of (base_dir, storage_options), each in a fresh bucket on the moto server."""
    return lambda: (f"s3://{make_bucket(s3_server)}/checkpoints", s3_options(s3_server))


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.object_store)])
def storage(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
    """(base_dir, storage_options) of an empty checkpoint root, local or on S3."""
    if request.param == "local":
        return str(tmp_path / "checkpoints"), {}
    endpoint = request.getfixturevalue("s3_server")
    return f"s3://{make_bucket(endpoint)}/checkpoints", s3_options(endpoint)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[Any]:
    """The session's GCS emulator (see ``helpers.clouds.GcsEmulator``)."""
    from helpers.clouds import GcsEmulator

    server = GcsEmulator()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azure_server() -> Iterator[Any]:
    """The session's Azurite (see ``helpers.clouds.AzuriteEmulator``)."""
    from helpers.clouds import AzuriteEmulator

    server = AzuriteEmulator()
    yield server
    server.stop()


@pytest.fixture
def demo_env(tmp_path: Path) -> dict[str, str]:
    """Environment for running the demo's definitions in a subprocess: a fresh DAGSTER_HOME
    with the repository's dagster.yaml, a small fast input, checkpoints under tmp_path."""
    root = Path(__file__).resolve().parents[1]
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((root / "dagster_home" / "dagster.yaml").read_text())
    env = dict(os.environ)
    env.update(
        DAGSTER_HOME=str(home),
        DEMO_TICKETS="2000",
        DEMO_LATENCY_MS="0",
        DEMO_ERROR_RATE="0",
        CHECKPOINT_BASE_DIR=str(tmp_path / "checkpoints"),
    )
    return env
