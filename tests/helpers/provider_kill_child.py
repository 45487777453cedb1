"""Child process of the provider batch kill tests: one run of a shard through a provider's batch
API (any case of ``helpers/provider_cases.py``), SIGKILLed at a chosen point.

``forked`` runs it in a child process forked from a warm server process; ``CASE`` names a
provider of ``helpers/provider_cases.py``, ``URLS`` are its fake's ``urls``. The point is
installed by wrapping the provider adapter's or the checkpoint's methods (no hook in the
package); ``none`` runs to the end. The tests run the next run in their own process with
``run_shard``.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import polars as pl

from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.providers.job import ProviderJob
from checkpoint_assets.engine.providers.provider_batches import provider_loop
from checkpoint_assets.engine.providers.submissions import BatchProvider, Result
from checkpoint_assets.engine.settings import RunStats
from helpers.kills import die
from helpers.provider_cases import BY_NAME, ProviderCase

NAME = "killed/default/all"
POINTS = (
    "before_upload",  # the submission's intent recorded, nothing sent
    "after_upload",  # the file uploaded, its id not recorded
    "after_create",  # the batch created, its id not recorded (Anthropic: found by custom_id)
    "downloading",  # half the results read
    "writing_part",  # the results' part being written, not durable
    "after_part",  # the part durable, the submission not yet marked collected
)
# With per-request errors: the first submission marked returned, its failed requests' new
# submission recorded (intent), nothing of it sent.
SENDING_AGAIN = "sending_again"


@contextmanager
def adapter(case: ProviderCase, urls: Mapping[str, str]) -> Iterator[BatchProvider]:
    """The case's batch adapter on its fake at ``urls``, the resource initialized outside
    Dagster (its credentials resolved from the environment)."""
    with case.resource(urls).process_config_and_initialize_cm() as resource:
        yield case.adapter(resource)


def after(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        fn(*args, **kwargs)
        die()

    return wrapped


def install(point: str, api: Any, rows: int) -> None:
    if point == "before_upload":
        api.upload = lambda *a, **k: die()
    elif point == "after_upload":
        api.upload = after(api.upload)
    elif point == "after_create":
        api.create = after(api.create)
    elif point == "downloading":
        results = api.results

        def half(batch_id: str) -> Iterator[Result]:
            for i, result in enumerate(results(batch_id)):
                if i == rows // 2:
                    die()
                yield result

        api.results = half
    elif point == "writing_part":
        Checkpoint.write_part = lambda *a, **k: die()  # type: ignore[method-assign]
    elif point == "after_part":
        Checkpoint.write_part = after(Checkpoint.write_part)  # type: ignore[method-assign]
    elif point == SENDING_AGAIN:
        upload, calls = api.upload, []

        def second_dies(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return die() if len(calls) == 2 else upload(*args, **kwargs)

        api.upload = second_dies


def run_shard(
    case: ProviderCase, urls: Mapping[str, str], base_dir: str, rows: int, point: str = "none"
) -> RunStats:
    """One run of the shard (killed at ``point``, if it is one of ``POINTS``)."""
    with adapter(case, urls) as api:
        install(point, api, rows)
        return _run(case, api, base_dir, rows)


def _run(case: ProviderCase, api: BatchProvider, base_dir: str, rows: int) -> RunStats:
    def request(row: dict[str, Any]) -> dict[str, Any]:
        return case.request(row["body"])

    job = ProviderJob(api, request, case.parse, poll_seconds=0.05, max_poll_seconds=0.2)
    # A row may fail at each of its attempts when the provider's error rate is on.
    settings = Settings(
        id_column="id", input_columns=("body",), progress_seconds=3600.0, max_failed_fraction=0.01
    )
    df = pl.DataFrame({"id": range(rows), "body": [f"ticket {i}" for i in range(rows)]})
    checkpoint = Checkpoint(open_store(base_dir), NAME)
    _, stats = run(
        provider_loop(job),
        prepare(df, settings),
        checkpoint,
        settings,
        job={"kill": 1},
    )
    return stats


def killed_run(
    name: str, urls: Mapping[str, str], base_dir: str, rows: int, point: str, env: Mapping[str, str]
) -> None:
    """A forked child's run (``forked``): the test's environment, then the run killed at
    ``point``; a traceback, if it ends another way, to ``<base_dir>.err``."""
    os.environ.update(env)
    try:
        run_shard(BY_NAME[name], urls, base_dir, rows, point)
    except BaseException:
        with open(f"{base_dir}.err", "w") as f:
            f.write(traceback.format_exc())
        raise


def forked(
    case: ProviderCase, urls: Mapping[str, str], base_dir: str, rows: int, point: str
) -> tuple[int | None, str]:
    """Run the shard in a child process killed at ``point``: its exit code (-9 when killed) and
    its traceback, if any.

    The child is forked from a server process that imported this module once (multiprocessing's
    ``forkserver``, with this module preloaded), so each child starts in milliseconds, with a
    single thread, and none of the test process's threads or locks."""
    process = _FORKS.Process(
        target=killed_run, args=(case.name, dict(urls), base_dir, rows, point, dict(os.environ))
    )
    with _server_path():
        process.start()
    process.join(300)
    if process.exitcode is None:
        process.kill()
        process.join()
    err = f"{base_dir}.err"
    return process.exitcode, open(err).read() if os.path.exists(err) else ""


@contextmanager
def _server_path() -> Iterator[None]:
    """The test process's ``sys.path`` as ``PYTHONPATH`` while a child starts: the first start
    starts the server, and Python 3.11's forkserver ignores the ``sys_path`` it is given, so
    without it the server could not import this module (a failed preload is silent) and every
    child would import it, Dagster and the provider's SDK again (about 2.5 CPU seconds each)."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


_FORKS = multiprocessing.get_context("forkserver")
# Imported in the server too, else in every child: the SDKs of the provider cases (a resource
# imports its own when it makes a client), and the storage of the ephemeral Dagster instance a
# resource is initialized with (imported when the first one is made).
_SDKS = ["openai", "anthropic", "google.genai", "boto3"]
_INSTANCE = ["dagster._core.storage.event_log", "dagster._core.storage.runs"]
_FORKS.set_forkserver_preload([__name__, *_SDKS, *_INSTANCE])
