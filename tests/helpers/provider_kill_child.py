"""Child process of the provider batch kill tests: one run of a shard through OpenAI's Batch API
or Anthropic's Message Batches, SIGKILLed at a chosen point.

Usage: ``python provider_kill_child.py BASE_URL BASE_DIR ROWS POINT [PROVIDER]`` (``openai``, the
default, or ``anthropic``). The point is installed by wrapping the provider adapter's or the
checkpoint's methods (no hook in the package); ``none`` runs to the end. The tests run the next
run in their own process with ``run_shard``.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import polars as pl

from checkpoint_assets.engine import Checkpoint, RunContext, Settings, open_store, prepare, run
from checkpoint_assets.engine.providers.job import ProviderJob
from checkpoint_assets.engine.providers.provider_batches import ProviderRun
from checkpoint_assets.engine.providers.submissions import BatchProvider, Result
from checkpoint_assets.engine.settings import RunStats

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


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


def parse(body: dict[str, Any]) -> dict[str, Any]:
    return {"answer": body["choices"][0]["message"]["content"]}


def parse_message(message: dict[str, Any]) -> dict[str, Any]:
    return {"answer": message["content"][0]["text"]}


def adapter(url: str, provider: str) -> tuple[BatchProvider, Callable[..., dict[str, Any]]]:
    """The provider's adapter on the local provider at ``url``, and the parse of its bodies.
    Only that provider's client is imported (``anthropic`` alone takes seconds of CPU)."""
    if provider == "anthropic":
        import anthropic

        from checkpoint_assets.resources.anthropic_batches import AnthropicBatches

        # find polls the batch a kill left unrecorded: poll it often
        claude = anthropic.Anthropic(
            base_url=url.removesuffix("/v1"), api_key="local", max_retries=5
        )
        defaults = {"model": "m", "max_tokens": 8}
        return AnthropicBatches(claude, defaults, find_poll_seconds=0.1), parse_message
    import openai

    from checkpoint_assets.resources.openai_batches import OpenAIBatches

    client = openai.OpenAI(base_url=url, api_key="local", max_retries=5)  # no Dagster to import
    return OpenAIBatches(client, defaults={"model": "m"}), parse


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
    url: str, base_dir: str, rows: int, point: str = "none", provider: str = "openai"
) -> RunStats:
    """One run of the shard (killed at ``point``, if it is one of ``POINTS``)."""
    api, parse_body = adapter(url, provider)
    install(point, api, rows)
    job = ProviderJob(api, request, parse_body, poll_seconds=0.05, max_poll_seconds=0.2)
    # A row may fail at each of its attempts when the provider's error rate is on.
    settings = Settings(
        id_column="id", input_columns=("body",), progress_seconds=3600.0, max_failed_fraction=0.01
    )
    df = pl.DataFrame({"id": range(rows), "body": [f"ticket {i}" for i in range(rows)]})
    checkpoint = Checkpoint(open_store(base_dir), NAME)
    _, stats = run(
        job,
        prepare(df, settings),
        checkpoint,
        settings,
        job={"kill": 1},
        context=RunContext(loop=ProviderRun),
    )
    return stats


if __name__ == "__main__":
    run_shard(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:6])
