"""``OpenAIResource`` and ``AnthropicResource`` against the local chat server, over real HTTP,
through the real ``openai`` and ``anthropic`` clients and real Dagster materializations."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest

if not all(importlib.util.find_spec(p) for p in ("openai", "anthropic")):  # extras; CI has them
    if os.environ.get("CI") == "true":
        pytest.fail("openai or anthropic is not installed: pip install -e '.[dev]'", pytrace=False)
    pytest.skip(
        "openai or anthropic is not installed: pip install -e '.[dev]'", allow_module_level=True
    )

import anthropic
import dagster as dg
import openai
import polars as pl

from checkpoint_assets import (
    AnthropicResource,
    CheckpointIOManager,
    OpenAIResource,
    checkpointed_asset,
    shard_partitions,
)
from checkpoint_assets.engine.calls.refusals import throttled
from examples.llm_openai.server import Settings, classify, serve, serve_process, stats
from examples.ticket_routing.data import generate_tickets

REPO = Path(__file__).resolve().parents[2]
Endpoint = OpenAIResource | AnthropicResource
KINDS = ["openai", "anthropic"]
#: The usage columns each API reports: (prompt, completion) tokens.
USAGE = {
    "openai": ("prompt_tokens", "completion_tokens"),
    "anthropic": ("input_tokens", "output_tokens"),
}


def endpoint(kind: str, base_url: str, **settings: Any) -> Endpoint:
    """The resource of ``kind`` for the local server at ``base_url`` (which ends in /v1)."""
    settings = {"api_key": "local", "model": "m", **settings}
    if kind == "openai":
        return OpenAIResource(base_url=base_url, **settings)
    return AnthropicResource(base_url=base_url.removesuffix("/v1"), **settings)


async def ask(chat: Endpoint, text: str) -> tuple[str, int, int]:
    """One request through the resource's async client: the answer, prompt and answer tokens."""
    messages: Any = [{"role": "user", "content": text}]
    if isinstance(chat, OpenAIResource):
        reply = await chat.client().chat.completions.create(
            messages=messages, **chat.request_defaults()
        )
        assert reply.usage is not None
        answer = reply.choices[0].message.content or ""
        return answer, reply.usage.prompt_tokens, reply.usage.completion_tokens
    message = await chat.client().messages.create(messages=messages, **chat.request_defaults())
    text_block = message.content[0]
    assert text_block.type == "text"
    return text_block.text, message.usage.input_tokens, message.usage.output_tokens


def ask_sync(chat: Endpoint, text: str) -> str:
    messages: Any = [{"role": "user", "content": text}]
    if isinstance(chat, OpenAIResource):
        reply = chat.sync_client().chat.completions.create(
            messages=messages, **chat.request_defaults()
        )
        return reply.choices[0].message.content or ""
    message = chat.sync_client().messages.create(messages=messages, **chat.request_defaults())
    assert message.content[0].type == "text"
    return message.content[0].text


def _materialize(
    asset: dg.AssetsDefinition,
    tickets: pl.DataFrame,
    chat: Endpoint,
    base_dir: Path,
    partition_key: str | None = None,
) -> dg.ExecuteInProcessResult:
    """Materialize ``asset`` (its source is "tickets", its resource "chat"), in process."""

    @dg.asset(name="tickets", io_manager_key="source_io")
    def source() -> pl.DataFrame:
        return tickets

    return dg.materialize(
        [source, asset],
        instance=dg.DagsterInstance.ephemeral(),
        resources={
            "io_manager": CheckpointIOManager(base_dir=str(base_dir)),
            "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
            "chat": chat,
        },
        partition_key=partition_key,
    )


# -- one client per event loop ----------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_one_client_per_event_loop_serves_every_call(kind: str) -> None:
    async def two_calls(chat: Endpoint) -> tuple[Any, list[str]]:
        answers = await asyncio.gather(ask(chat, "refund please"), ask(chat, "tracking?"))
        # Dagster makes a new resource object per run: the same settings share the client.
        same_settings = chat.model_copy()
        assert chat.client() is chat.client() is same_settings.client()
        return chat.client(), [a for a, _, _ in answers]

    with serve() as base_url:
        chat = endpoint(kind, base_url)
        # A client reused on a second event loop fails with "Event loop is closed".
        first, answers = asyncio.run(two_calls(chat))
        second, again = asyncio.run(two_calls(chat))
        served = stats(base_url)

    assert answers == again == ["billing", "shipping"]
    assert first is not second
    assert served["ok"] == 4


@pytest.mark.parametrize("kind", KINDS)
def test_a_different_configuration_gets_its_own_client(kind: str) -> None:
    async def clients() -> list[Any]:
        base = endpoint(kind, "http://127.0.0.1:9/v1")
        other_key = base.model_copy(update={"api_key": "other"})
        other_timeout = base.model_copy(update={"timeout_seconds": 5.0})
        return [base.client(), other_key.client(), other_timeout.client()]

    made = asyncio.run(clients())

    assert len({id(c) for c in made}) == 3
    assert made[1].api_key == "other" and made[2].timeout == 5.0


def test_a_run_releases_the_clients_of_its_event_loops(tmp_path: Path) -> None:
    made: list[weakref.ref[Any]] = []

    @checkpointed_asset(source="tickets", id_column="ticket_id", batch_size=1)
    async def department(batch: pl.DataFrame, chat: OpenAIResource) -> pl.DataFrame:
        made.append(weakref.ref(chat.client()))
        answer, _, _ = await ask(chat, batch["body"][0])
        return batch.select("ticket_id", department=pl.lit(answer))

    with serve() as base_url:
        chat = endpoint("openai", base_url, api_key="released")
        for run in ("first", "second"):  # a long-lived process runs shard after shard
            assert _materialize(department, generate_tickets(3), chat, tmp_path / run).success
    gc.collect()

    assert len(made) == 6
    assert all(client() is None for client in made)


@pytest.mark.parametrize("kind", KINDS)
def test_the_sync_client_is_shared_by_the_threads_of_a_plain_function(kind: str) -> None:
    seen: list[tuple[Any, str]] = []

    def call(chat: Endpoint, text: str) -> None:
        seen.append((chat.sync_client(), ask_sync(chat, text)))

    with serve() as base_url:
        chat = endpoint(kind, base_url)
        threads = [threading.Thread(target=call, args=(chat, t)) for t in ("refund", "tracking")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    assert sorted(answer for _, answer in seen) == ["billing", "shipping"]
    assert seen[0][0] is seen[1][0] is chat.sync_client()


def test_the_async_client_outside_an_event_loop_says_to_use_async_def() -> None:
    chat = endpoint("anthropic", "http://127.0.0.1:9/v1")
    with pytest.raises(RuntimeError, match=r"async def.*AnthropicResource\.sync_client\(\)"):
        chat.client()


# -- rate limits reach the package --------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_rate_limit_reaches_the_caller_without_hidden_retries(kind: str) -> None:
    with serve(rate_429=1.0, retry_after_seconds=0.25) as base_url:
        with pytest.raises((openai.RateLimitError, anthropic.RateLimitError)) as raised:
            asyncio.run(ask(endpoint(kind, base_url), "refund please"))
        served = stats(base_url)

    assert served["rate_limited"] == served["requests"] == 1
    pause = throttled(raised.value)
    assert pause is not None and pause.seconds == 0.25


@pytest.mark.parametrize(
    "kind, settings, error",
    [
        ("openai", {"rate_429": 1.0}, openai.RateLimitError),
        ("openai", {"rate_529": 1.0}, openai.InternalServerError),
        ("anthropic", {"rate_429": 1.0}, anthropic.RateLimitError),
        ("anthropic", {"rate_529": 1.0}, anthropic.OverloadedError),
    ],
    ids=["openai-429", "openai-529", "anthropic-429", "anthropic-529"],
)
def test_each_throttle_of_the_real_clients_is_recognised_as_one(
    kind: str, settings: dict[str, float], error: type[Exception]
) -> None:
    with serve(**settings) as base_url, pytest.raises(error) as raised:
        asyncio.run(ask(endpoint(kind, base_url), "refund please"))

    # 529 is Anthropic's "overloaded": a pause of the shard, not a failure of the rows.
    assert throttled(raised.value) is not None


# -- through a checkpointed asset ----------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpointed_async_asset_stores_the_answers_and_sums_the_usage(
    kind: str, tmp_path: Path
) -> None:
    tickets = generate_tickets(80)
    prompt_col, answer_col = USAGE[kind]
    clients: list[Any] = []

    @checkpointed_asset(
        source="tickets",
        id_column="ticket_id",
        input_columns=["subject", "body"],
        partitions_def=shard_partitions(2),
        batch_size=1,
        checkpoint_interval=8,
        max_concurrency=8,
        retry_delay_seconds=0.05,
        usage_columns=[prompt_col, answer_col],
    )
    async def department(batch: pl.DataFrame, chat: dg.ResourceParam[Any]) -> pl.DataFrame:
        (ticket,) = batch.iter_rows(named=True)
        clients.append(chat.client())
        answer, prompt, completion = await ask(chat, f"{ticket['subject']}\n\n{ticket['body']}")
        return pl.DataFrame(
            {
                "ticket_id": [ticket["ticket_id"]],
                "department": [answer],
                prompt_col: [prompt],
                answer_col: [completion],
            }
        )

    # A fifth of the requests refused with 429 at first (retry after 50 ms), 20 ms per answer.
    flaky = Settings(latency_ms=20, rate_429=0.2, retry_after_seconds=0.05, seed=1)
    with serve_process(flaky) as base_url:
        chat = endpoint(kind, base_url)
        result = _materialize(department, tickets, chat, tmp_path, partition_key="0-of-2")
        served = stats(base_url)

    assert result.success
    (event,) = result.asset_materializations_for_node("department")
    meta = {k: v.value for k, v in event.metadata.items()}
    stored = pl.read_parquet(tmp_path / "department" / "default" / "0-of-2.parquet")
    expected = tickets.filter(pl.col("ticket_id").is_in(stored["ticket_id"].to_list()))
    assert stored.height == meta["rows_total"] == served["ok"] and meta["rows_failed"] == 0
    assert 0 < stored.height < tickets.height  # one of two shards
    by_id = dict(zip(stored["ticket_id"], stored["department"], strict=True))
    for ticket_id, subject, body in expected.select("ticket_id", "subject", "body").iter_rows():
        assert by_id[ticket_id] == classify(f"{subject}\n\n{body}")
    # The tokens the server counted are the metadata's sums.
    assert meta[f"usage/{prompt_col}"] == served["prompt_tokens"] > 0
    assert meta[f"usage/{answer_col}"] == served["completion_tokens"] == stored.height
    # Every 429 reached the package (no hidden retries in the client), which waited and sent
    # the call again; no row failed.
    assert meta["throttled_calls"] == served["rate_limited"] > 0
    assert served["requests"] == served["ok"] + served["rate_limited"]
    # Every call of the run shared one client.
    assert len({id(c) for c in clients}) == 1


def test_an_async_asset_gets_its_endpoint_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @dg.asset
    async def departments(
        openai_chat: OpenAIResource, claude: AnthropicResource
    ) -> list[tuple[str, int, int]]:
        return [await ask(openai_chat, "I was charged twice"), await ask(claude, "tracking?")]

    with serve() as base_url:
        monkeypatch.setenv("OPENAI_BASE_URL", base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "local")
        # The anthropic client reads ANTHROPIC_BASE_URL itself when base_url is unset.
        monkeypatch.setenv("ANTHROPIC_BASE_URL", base_url.removesuffix("/v1"))
        monkeypatch.setenv("ANTHROPIC_API_KEY", "local")
        resources = {
            "openai_chat": OpenAIResource(
                base_url=dg.EnvVar("OPENAI_BASE_URL"),
                api_key=dg.EnvVar("OPENAI_API_KEY"),
                model="m",
            ),
            "claude": AnthropicResource(
                api_key=dg.EnvVar("ANTHROPIC_API_KEY"), model="m", max_tokens=8
            ),
        }
        result = dg.materialize([departments], resources=resources)
        served = stats(base_url)

    answers = result.output_for_node("departments")
    assert [a for a, _, _ in answers] == ["billing", "shipping"]
    assert served["ok"] == 2


# -- settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, settings",
    [("openai", {"max_tokens": 8, "temperature": 0.2}), ("anthropic", {"max_tokens": 8})],
)
def test_the_fingerprint_holds_the_settings_that_change_answers_and_no_secret(
    kind: str, settings: dict[str, Any]
) -> None:
    chat = endpoint(kind, "http://secret-host:9/v1", api_key="sk-secret", model="m1", **settings)
    fingerprint = chat.checkpoint_fingerprint()

    assert fingerprint == {"api": kind, "model": "m1", **settings}
    assert "secret" not in repr(fingerprint)
    for unchanged in (
        {"api_key": "sk-other"},
        {"base_url": "http://other:9"},
        {"timeout_seconds": 1.0},
        {"max_retries": 2},
    ):
        assert chat.model_copy(update=unchanged).checkpoint_fingerprint() == fingerprint
    for name, value in {"model": "m2", **settings}.items():
        changed = chat.model_copy(update={name: value * 2})
        assert changed.checkpoint_fingerprint() != fingerprint, name


def test_request_defaults_send_only_the_settings_that_are_set() -> None:
    assert OpenAIResource(api_key="k", model="m").request_defaults() == {"model": "m"}
    assert OpenAIResource(api_key="k", model="m", temperature=0).request_defaults() == {
        "model": "m",
        "temperature": 0.0,
    }
    # An unset setting is still in the fingerprint: setting it later changes the answers.
    assert OpenAIResource(api_key="k", model="m").checkpoint_fingerprint() == {
        "api": "openai",
        "model": "m",
        "max_tokens": None,
        "temperature": None,
    }
    # The Messages API requires max_tokens: the Anthropic resource always has one.
    assert AnthropicResource(api_key="k", model="m").request_defaults() == {
        "model": "m",
        "max_tokens": 1024,
    }


def test_without_the_packages_the_resources_import_and_name_the_extra_to_install() -> None:
    script = """
import asyncio, sys
sys.modules["openai"] = sys.modules["anthropic"] = None  # as if not installed
import checkpoint_assets
from checkpoint_assets import AnthropicResource, OpenAIResource
chat = OpenAIResource(api_key="k", model="m")
print(chat.checkpoint_fingerprint()["model"])
async def client():
    return chat.client()
for call in (chat.sync_client, lambda: asyncio.run(client()),
             AnthropicResource(api_key="k", model="m").sync_client):
    try:
        call()
    except ModuleNotFoundError as e:
        print(e)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "m"
    openai_missing = (
        "OpenAIResource needs the `openai` package, which is not installed: "
        'pip install "checkpoint-assets[openai]"'
    )
    assert lines[1:] == [
        openai_missing,
        openai_missing,
        "AnthropicResource needs the `anthropic` package, which is not installed: "
        'pip install "checkpoint-assets[anthropic]"',
    ]
