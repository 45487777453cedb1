"""``checkpoint-assets status`` over many checkpoints on moto's S3 server: time and requests.

At every size ``n`` a fresh bucket holds ``n`` checkpoints of one asset (``<i>-of-<n>``), as a
backfill of ``n`` shards leaves them: nine in ten finished (meta and merged file), one in ten
interrupted (meta, merged file and two unmerged parts) and held by a live run (a lock file).
Both kinds are real checkpoints written by the engine, copied under each shard's name.

The command runs in a child process (``python -c`` calling ``cli.main``; its start-up alone, with
no checkpoints, is reported apart) against the moto server of ``tests/conftest.py``, which counts
the requests it serves. Reported per size: seconds, the command's own CPU seconds, requests by
kind, and requests per checkpoint. The server runs in the benchmark's process, on the same cores:
where the command's CPU is a small part of its seconds, the time is the server's.
"""

import contextlib
import json
import logging
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench import data
from bench.report import Result
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.loop import runner
from checkpoint_assets.engine.loop.lock import Lease
from checkpoint_assets.engine.storage import open_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = 2_000  # per checkpoint
ASSET = "scored"


@contextlib.contextmanager
def _moto() -> Iterator[Any]:
    """The tests' counting moto server (``tests/conftest.py``), answering each request after
    ``server.latency`` seconds (0 at first): moto on 127.0.0.1 answers in about a millisecond,
    S3 in tens of them."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    try:
        from conftest import CountingMotoServer
    finally:
        sys.path.pop(0)

    class SlowMoto(CountingMotoServer):  # type: ignore[misc]
        latency = 0.0

        def _counting(self, app: Any) -> Any:
            counted = super()._counting(app)

            def wsgi(environ: dict[str, Any], start_response: Any) -> Any:
                time.sleep(self.latency)  # the server is threaded: requests wait side by side
                return counted(environ, start_response)

            return wsgi

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = SlowMoto()
    try:
        yield server
    finally:
        server.stop()


def _templates(workdir: str) -> dict[str, dict[str, bytes]]:
    """A finished and an interrupted checkpoint, as {file name suffix: content}."""
    root = os.path.join(workdir, "status-templates")
    frame = data.make_input(ROWS)
    data.build_finished(root, "finished", frame, interval=500)
    # Interrupted: the first half finished, then a run that flushed two parts and was stopped.
    data.build_finished(root, "interrupted", frame.head(ROWS // 2), interval=500)
    config = data.settings(250)
    calls = 0

    def stopped_after_two(batch: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise KeyboardInterrupt  # SIGINT: flushes what is done, does not finalize
        return data.score(batch)

    checkpoint = Checkpoint(open_store(root), "interrupted")
    with contextlib.suppress(KeyboardInterrupt):
        runner.run(
            stopped_after_two, runner.prepare(frame, config), checkpoint, config, job=data.JOB
        )
    Lease(checkpoint.store, checkpoint.files.lock, run_id="bench-live-run").acquire()
    out: dict[str, dict[str, bytes]] = {}
    for name in ("finished", "interrupted"):
        files: dict[str, bytes] = {}
        for folder, _, names in os.walk(root):
            for each in names:
                path = os.path.join(folder, each)
                rel = os.path.relpath(path, root)
                if rel.startswith(name + "."):
                    with open(path, "rb") as f:
                        files[rel[len(name) :]] = f.read()
        out[name] = files
    return out


def _fill(endpoint: str, bucket: str, n: int, templates: dict[str, dict[str, bytes]]) -> int:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    uploads = [
        (f"checkpoints/{ASSET}/default/{i}-of-{n}{suffix}", content)
        for i in range(n)
        for suffix, content in templates["interrupted" if i % 10 == 0 else "finished"].items()
    ]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda u: s3.put_object(Bucket=bucket, Key=u[0], Body=u[1]), uploads))
    return len(uploads)


def _status(
    server: Any, bucket: str, readers: int
) -> tuple[float, float, Counter[str], list[dict[str, Any]]]:
    """``checkpoint-assets status --json`` in a child process (the server keeps this one busy),
    reading ``readers`` checkpoints at once (1: one after the other, as before)."""
    before = server.requests(bucket)
    code = (
        "import sys; from checkpoint_assets import cli; from checkpoint_assets.cli import status; "
        f"status.STATUS_READERS = {readers}; sys.exit(cli.main(sys.argv[1:]))"
    )
    argv = [
        *(sys.executable, "-c", code, "status", f"s3://{bucket}/checkpoints", "--json"),
        *("-o", f'client_kwargs={{"endpoint_url": "{server.endpoint}"}}'),
    ]
    cpu = _children_cpu()
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=REPO)
    seconds = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-2000:]
    requests = server.requests(bucket)
    requests.subtract(before)
    return seconds, _children_cpu() - cpu, +requests, json.loads(done.stdout)


def _children_cpu() -> float:
    """CPU seconds of this process's ended children: the command's own, apart from the server's,
    which runs in this process and shares the machine's cores with it."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def status_scale(
    sizes: tuple[int, ...], workdir: str, repeat: int, latency: float = 0.02
) -> Result:
    """Seconds and requests of ``status --json`` over ``n`` checkpoints, for each size: read
    16 at a time (now) and one after the other (before), on moto as it is and with ``latency``
    seconds per request."""
    result = Result("status_s3", "checkpoint-assets status over n checkpoints, moto S3 server")
    templates = _templates(workdir)
    with _moto() as server:
        empty = f"bench-status-empty-{os.getpid()}"
        _fill(server.endpoint, empty, 0, templates)
        startup = min(_status(server, empty, 1)[0] for _ in range(max(repeat, 1)))
        result.add("start-up (no checkpoints)", startup, "s")
        for n in sizes:
            bucket = f"bench-status-{n}-{os.getpid()}"
            files = _fill(server.endpoint, bucket, n, templates)
            details: dict[str, Any] = {"files": files}
            for delay in (0.0, latency):
                server.latency = delay
                for readers, how in ((16, "concurrent"), (1, "sequential")):
                    if n > 1000 and readers == 1 and delay:
                        continue  # minutes, and no news: a round trip per request
                    runs = [_status(server, bucket, readers) for _ in range(max(repeat, 1))]
                    seconds, cpu = sorted((r[0], r[1]) for r in runs)[len(runs) // 2]
                    requests, listed = runs[0][2], runs[0][3]
                    assert len(listed) == n, len(listed)
                    assert not any(s["error"] for s in listed)
                    assert sum(1 for s in listed if s["lock"]) == (n + 9) // 10
                    label = f"{how}, {delay * 1000:g} ms per request"
                    details[label] = {"seconds": seconds, "cpu": cpu, "requests": dict(requests)}
                    result.add(f"{n} checkpoints: {label}", seconds, "s")
                    result.add(f"{n} checkpoints: {label}, the command's CPU", cpu, "s")
            server.latency = 0.0
            total = sum(requests.values())
            details["requests_per_checkpoint"] = total / n
            result.details[str(n)] = details
            result.add(f"{n} checkpoints: requests", total, "")
    return result
