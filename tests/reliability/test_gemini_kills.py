"""A shard's run through Gemini's Batch Mode or Vertex AI's batch prediction, SIGKILLed after the
upload, after the create or during the download, pays for no request twice and stores every row
once.

Each test kills one real process (``helpers/gemini_kill_child.py``) at one point, then runs the
shard again to the end in the test's process, against the fake of ``helpers/gemini_fake.py``,
which counts what it answered: requests processed equal the rows and no row's request was
answered twice (``paid_twice``), one job was created, and the rows stored by the killed run plus
those of the next run are the rows, each once.

``PYTHONPATH=tests:. python tests/reliability/test_gemini_kills.py ROWS`` runs a backfill: four
shards of ``ROWS / 4`` rows on each backend, shard 0 killed after its upload, shard 1 after its
create, shard 2 during its download, shard 3 not at all; then each shard run again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("google.genai") is None:  # optional extra; CI must have it
    if os.environ.get("CI") == "true":
        pytest.fail("pip install -e '.[gemini]'", pytrace=False)
    pytest.skip("pip install -e '.[gemini]'", allow_module_level=True)

from helpers import gemini_kill_child
from helpers.gemini_fake import Fake, Settings, serve, service_account_file

from checkpoint_assets.engine import Checkpoint, open_store

CHILD = Path(gemini_kill_child.__file__)
ROWS = 400
POINTS = ("after_upload", "after_create", "downloading")


@contextmanager
def backend(name: str, workdir: str, gcs: Any = None) -> Iterator[tuple[Fake, dict[str, Any]]]:
    """The fake, and the ``GeminiResource`` fields that reach it: the Gemini API with every
    submission as a file (so that there is an upload), or Vertex AI on ``gcs``."""
    settings = Settings(pending_seconds=0.05, running_seconds=0.2)
    if name == "vertex":
        storage, options = gcs.new_storage()
        settings.storage_options = options
    with serve(settings) as (url, fake):
        fields: dict[str, Any] = {"model": "gemini-test", "base_url": url}
        if name == "vertex":
            key = service_account_file(os.path.join(workdir, "key.json"), url)
            os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = key
            fields |= {
                "vertexai": True,
                "project": "test-project",
                "location": "us-central1",
                "gcs_prefix": storage.replace("/checkpoints", "/batches"),
                "storage_options": options,
            }
        else:
            fields |= {"api_key": "local", "inline_max_bytes": 1}
        yield fake, fields


def child(fields: dict[str, Any], base_dir: str, rows: int, shard: int, point: str) -> Any:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    config = {"resource": fields, "base_dir": base_dir, "rows": rows, "shard": shard}
    command = [sys.executable, str(CHILD), json.dumps(config | {"point": point})]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def stored(base_dir: str, shard: int) -> Any:
    checkpoint = Checkpoint(open_store(base_dir), gemini_kill_child.name(shard))
    return checkpoint.load("id").rows if checkpoint.meta_file.read() else None


@pytest.fixture(params=["gemini", "vertex"])
def fake_backend(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Fake, dict[str, Any]]]:
    gcs = request.getfixturevalue("gcs_server") if request.param == "vertex" else None
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "")  # set again by backend()
    with backend(request.param, str(tmp_path), gcs) as found:
        yield found


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_each_point_pays_nothing_twice_and_stores_each_row_once(
    point: str, fake_backend: tuple[Fake, dict[str, Any]], tmp_path: Path
) -> None:
    fake, fields = fake_backend
    base_dir = str(tmp_path / "checkpoints")
    killed = child(fields, base_dir, ROWS, 0, point)
    assert killed.returncode == -9, killed.stderr[-2000:]
    before = stored(base_dir, 0)
    run = gemini_kill_child.run_shard(fields, base_dir, ROWS, 0)
    counted = fake.snapshot()
    assert counted["processed"] == ROWS and counted["paid_twice"] == 0
    assert counted["creates"] == 1  # found again by its display name, not created again
    done_before = 0 if before is None else before.height
    assert done_before + run.rows_computed == ROWS  # nothing stored twice
    rows = stored(base_dir, 0)
    assert rows.height == ROWS and rows.get_column("_error").null_count() == ROWS


def backfill(rows: int) -> dict[str, dict[str, int]]:
    """The report's backfill (see the module docstring) on each backend: what the fake counted,
    and the rows stored, each once."""
    from helpers.clouds import GcsEmulator

    shards = 4
    per_shard = rows // shards
    found = {}
    with ExitStack() as stack:
        gcs = GcsEmulator()
        stack.callback(gcs.stop)
        for name in ("gemini", "vertex"):
            workdir = stack.enter_context(tempfile.TemporaryDirectory())
            fake, fields = stack.enter_context(backend(name, workdir, gcs))
            base_dir = os.path.join(workdir, "checkpoints")
            kills = 0
            for shard, point in enumerate((*POINTS, "none")):
                killed = child(fields, base_dir, per_shard, shard, point)
                kills += killed.returncode == -9
            for shard in range(shards):
                gemini_kill_child.run_shard(fields, base_dir, per_shard, shard)
            frames = [stored(base_dir, shard) for shard in range(shards)]
            ids = [i for frame in frames for i in frame.get_column("id").to_list()]
            counted = fake.snapshot()
            found[name] = {
                "rows": rows,
                "kills": kills,
                "rows_stored": len(ids),
                "distinct_rows_stored": len(set(ids)),
                "jobs_created": counted["creates"],
                "requests_processed": counted["processed"],
                "rows_paid_twice": counted["paid_twice"],
            }
    return found


if __name__ == "__main__":
    print(json.dumps(backfill(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000), indent=2))
