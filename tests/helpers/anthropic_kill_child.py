"""Driver process for the Anthropic kill tests: one shard through Message Batches, SIGKILLed at a
chosen point, then run again to the end.

Usage: ``python anthropic_kill_child.py SPEC_FILE`` (JSON: ``base_url`` of the local provider,
``base_dir`` of the checkpoints, ``rows``, ``point``, ``report``). The driver imports everything
once and forks two runs of the engine (``ProviderRun`` on ``AnthropicBatches``): the first
installs the kill point by wrapping methods (no hook in the package) and SIGKILLs itself when it
is reached (``os.kill(os.getpid(), SIGKILL)``: no handler, no flush, no cleanup); the second runs
clean. ``report`` gets both exit statuses (negative: the signal).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import polars as pl

from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.provider_batches import ProviderJob, ProviderRun
from checkpoint_assets.engine.storage import local as local_module
from checkpoint_assets.engine.storage.local import LocalStore
from checkpoint_assets.engine.submission_records import Records
from checkpoint_assets.resources.anthropic_batches import AnthropicBatches

ID = "ticket_id"
CHECKPOINT = "killed/default/all"
TEXTS = ("I was charged twice, please refund me", "The app crashes with an error", "hello")
POINTS = (
    "before_upload",  # the submission's intent recorded, nothing sent
    "after_upload",  # upload done (nothing, for Anthropic), the create not sent
    "after_create",  # the batch created, its id not recorded
    "while_downloading",  # in the middle of reading the batch's results
    "while_writing_part",  # half of the collected part's bytes written
    "before_collected",  # the collected part durable, the record not yet marked collected
)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _after(cls: type, name: str) -> None:
    """Kill right after ``cls.name`` returns."""
    real = getattr(cls, name)

    def killing(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        die()

    setattr(cls, name, killing)


def install(point: str) -> None:
    if point == "before_upload":
        _after(Records, "record_intent")
    elif point == "after_upload":
        _after(AnthropicBatches, "upload")
    elif point == "after_create":
        _after(AnthropicBatches, "create")
    elif point == "while_downloading":
        lines = AnthropicBatches._lines

        def halfway(self: AnthropicBatches, batch_id: str) -> Iterator[dict[str, Any]]:
            for n, line in enumerate(lines(self, batch_id)):
                if n == 1000:
                    die()
                yield line

        AnthropicBatches._lines = halfway  # type: ignore[method-assign]
    elif point == "while_writing_part":
        put = LocalStore.put

        def half_put(self: LocalStore, path: str, data: bytes) -> None:
            if ".parquet.parts/" in path:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(local_module.temporary_path(path), "wb") as f:
                    f.write(data[: len(data) // 2])
                die()
            put(self, path, data)

        LocalStore.put = half_put  # type: ignore[method-assign]
    elif point == "before_collected":
        advance = Records.advance

        def before(self: Records, submission: Any, stage: str, **changes: Any) -> None:
            if stage == "collected":
                die()
            advance(self, submission, stage, **changes)

        Records.advance = before  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown point {point!r}; one of {POINTS}")


def one_run(spec: dict[str, Any]) -> None:
    rows = spec["rows"]
    df = pl.DataFrame({ID: list(range(rows)), "body": [TEXTS[i % 3] for i in range(rows)]})
    settings = Settings(
        id_column=ID,
        input_columns=("body",),
        min_flush_seconds=0.0,
        progress_seconds=3600.0,
        max_failed_fraction=1.0,
    )
    client = anthropic.Anthropic(base_url=spec["base_url"], api_key="local", max_retries=5)
    api = AnthropicBatches(client, {"model": "claude-test", "max_tokens": 8}, find_poll_seconds=0.1)
    job = ProviderJob(
        api,
        lambda row: {"messages": [{"role": "user", "content": row["body"]}]},
        lambda message: {"answer": message["content"][0]["text"]},
        poll_seconds=0.05,
        max_poll_seconds=0.2,
    )
    checkpoint = Checkpoint(open_store(spec["base_dir"]), CHECKPOINT)
    run(job, prepare(df, settings), checkpoint, settings, job={"kills": 1}, loop=ProviderRun)


def forked(body: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            body()
        except BaseException:
            traceback.print_exc()
            os._exit(3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)

    def killed() -> None:
        install(spec["point"])
        one_run(spec)

    statuses = [forked(killed), forked(lambda: one_run(spec))]
    with open(spec["report"], "w") as f:
        json.dump(statuses, f)


if __name__ == "__main__":
    main(sys.argv[1])
