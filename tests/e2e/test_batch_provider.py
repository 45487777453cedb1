"""The local batch provider, through the real ``openai`` and ``anthropic`` clients over HTTP.

The provider-batch tests and the ``llm_batch`` example rely on it behaving like OpenAI's Batch
API and Anthropic's Message Batches: the states a batch moves through, result files in the
providers' shapes, per-request errors, expiry, cancellation, pagination and limits refused as the
clients raise them, and ``/stats`` counting every call and every request processed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("openai") is None or importlib.util.find_spec("anthropic") is None:
    # optional extras; CI must have them
    if os.environ.get("CI") == "true":
        pytest.fail("pip install -e '.[openai,anthropic]'", pytrace=False)
    pytest.skip("pip install -e '.[openai,anthropic]'", allow_module_level=True)

import anthropic
import openai

from examples.llm_batch.provider import ManualClock, Settings, serve, serve_process, stats

CHAT = "/v1/chat/completions"
TEXTS = ("I was charged twice, please refund me", "The app crashes with an error", "hello")
ANSWERS = ("billing", "technical", "other")


def chat_line(i: int, custom_id: str | None = None) -> dict[str, Any]:
    text = TEXTS[i % 3]
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": text}]}
    return {"custom_id": custom_id or f"req-{i}", "method": "POST", "url": CHAT, "body": body}


def message_request(i: int, custom_id: str | None = None) -> dict[str, Any]:
    messages = [{"role": "user", "content": TEXTS[i % 3]}]
    params = {"model": "claude-test", "max_tokens": 16, "messages": messages}
    return {"custom_id": custom_id or f"req-{i}", "params": params}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_800_000_000.0)


def clients(base_url: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (
        openai.OpenAI(base_url=base_url, api_key="local", max_retries=0, timeout=30),
        anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="local", max_retries=0),
    )


def submit(client: openai.OpenAI, lines: list[dict[str, Any]], **metadata: str) -> str:
    upload = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint=CHAT,
        completion_window="24h",
        metadata=metadata or None,
    )
    assert batch.status == "validating"
    return batch.id


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def walk(clock: ManualClock, poll: Any, steps: int) -> Iterator[Any]:
    """Poll once per second of the manual clock."""
    for _ in range(steps):
        yield poll()
        clock.advance(1.0)


@pytest.fixture
def staged(clock: ManualClock) -> Iterator[str]:
    settings = Settings(validating_seconds=1, processing_delay=4, finalizing_seconds=1)
    with serve(settings, clock=clock) as base_url:
        yield base_url


def test_an_openai_batch_moves_through_every_state_to_its_output_file(
    staged: str, clock: ManualClock
) -> None:
    client, _ = clients(staged)
    batch_id = submit(client, [chat_line(i) for i in range(8)], tag="ca-1")

    seen = list(walk(clock, lambda: client.batches.retrieve(batch_id), 8))

    statuses = [b.status for b in seen]
    assert list(dict.fromkeys(statuses)) == ["validating", "in_progress", "finalizing", "completed"]
    done = [b.request_counts.completed for b in seen if b.request_counts]
    assert done == sorted(done) and 0 < done[2] < 8, "requests end one after another"
    final = seen[-1]
    assert final.metadata == {"tag": "ca-1"}
    assert final.request_counts and final.request_counts.total == 8
    assert (final.request_counts.completed, final.request_counts.failed) == (8, 0)
    assert final.in_progress_at and final.finalizing_at and final.completed_at
    assert final.error_file_id is None
    output = lines_of(client, final.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{i}" for i in range(8))
    for line in output:
        i = int(line["custom_id"].removeprefix("req-"))
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["choices"][0]["message"]["content"] == ANSWERS[i % 3]
        assert body["usage"]["prompt_tokens"] == len(TEXTS[i % 3].split())
    assert final.usage and final.usage.output_tokens == 8
    served = stats(staged)
    assert (served["uploads"], served["creates"], served["downloads"]) == (1, 1, 1)
    assert served["retrieves"] == served["polls"] == 8
    assert served["submitted"] == served["processed"] == served["succeeded"] == 8


def test_a_message_batch_reports_counts_once_ended_and_one_result_per_request(
    staged: str, clock: ManualClock
) -> None:
    _, claude = clients(staged)
    created = claude.messages.batches.create(requests=[message_request(i) for i in range(6)])
    assert created.processing_status == "in_progress" and created.results_url is None

    seen = list(walk(clock, lambda: claude.messages.batches.retrieve(created.id), 8))

    assert list(dict.fromkeys(b.processing_status for b in seen)) == ["in_progress", "ended"]
    assert [b.request_counts.processing for b in seen[:3]] == [6, 6, 6]
    ended = seen[-1]
    assert ended.request_counts.succeeded == 6 and ended.request_counts.processing == 0
    assert ended.ended_at is not None and ended.results_url
    results = list(claude.messages.batches.results(created.id))
    assert sorted(r.custom_id for r in results) == sorted(f"req-{i}" for i in range(6))
    for r in results:
        assert r.result.type == "succeeded"
        i = int(r.custom_id.removeprefix("req-"))
        assert r.result.message.content[0].text == ANSWERS[i % 3]  # type: ignore[union-attr]
        assert r.result.message.usage.output_tokens == 1
    served = stats(staged)
    assert served["creates"] == 1 and served["downloads"] == 1
    assert served["submitted"] == served["processed"] == 6


def test_per_request_errors_are_a_seeded_share_in_the_error_file_and_a_retry_draws_again() -> None:
    settings = Settings(error_rate=0.2, seed=7)
    lines = [chat_line(i) for i in range(300)]
    lines.append({**chat_line(0, "malformed"), "body": {"model": "gpt-test"}})
    failed_runs = []
    for _ in range(2):  # the same seed on a new provider fails the same requests
        with serve(settings) as base_url:
            client, _ = clients(base_url)
            batch = wait_for(client, submit(client, lines))
            errors = lines_of(client, batch.error_file_id)
            failed_runs.append(sorted(line["custom_id"] for line in errors))
            assert batch.request_counts and batch.request_counts.failed == len(errors)
            assert len(lines_of(client, batch.output_file_id)) + len(errors) == 301
            statuses = {line["custom_id"]: line["response"]["status_code"] for line in errors}
            assert statuses.pop("malformed") == 400
            assert set(statuses.values()) == {500}
            assert 30 <= len(statuses) <= 90, "about 20% of 300"
            again = wait_for(client, submit(client, [chat_line(0, c) for c in statuses]))
            refailed = lines_of(client, again.error_file_id)
            assert len(refailed) < len(statuses) / 2, "a retried request draws again"
            served = stats(base_url)
            assert served["errored"] == len(errors) + len(refailed)
            assert served["processed"] == served["submitted"] == 301 + len(statuses)
    assert failed_runs[0] == failed_runs[1]

    with serve(settings) as base_url:
        _, claude = clients(base_url)
        bad = {"custom_id": "malformed", "params": {"model": "m", "messages": []}}
        batch = claude.messages.batches.create(requests=[message_request(0), bad])
        results = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
    assert results["malformed"].type == "errored"
    assert results["malformed"].error.error.type == "invalid_request_error"  # type: ignore[union-attr]


def wait_for(client: openai.OpenAI, batch_id: str) -> openai.types.Batch:
    for _ in range(200):
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.01)
    raise AssertionError(f"batch {batch_id} did not end: {batch.status}")


def test_an_expired_batch_keeps_what_it_finished_and_returns_the_rest(
    clock: ManualClock,
) -> None:
    settings = Settings(processing_delay=60, expire_rate=1.0, expire_after=10)
    with serve(settings, clock=clock) as base_url:
        client, claude = clients(base_url)
        batch_id = submit(client, [chat_line(i) for i in range(10)])
        created = claude.messages.batches.create(requests=[message_request(i) for i in range(10)])
        clock.advance(5)
        assert client.batches.retrieve(batch_id).status == "in_progress"
        clock.advance(5)
        batch = client.batches.retrieve(batch_id)
        ended = claude.messages.batches.retrieve(created.id)
        results = list(claude.messages.batches.results(created.id))
        output = lines_of(client, batch.output_file_id)
        errors = lines_of(client, batch.error_file_id)
        served = stats(base_url)

    assert batch.status == "expired" and batch.expired_at is not None
    assert sorted(line["custom_id"] for line in output) == [f"req-{i}" for i in range(5)]
    assert sorted(line["custom_id"] for line in errors) == [f"req-{i}" for i in range(5, 10)]
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}
    assert all(line["response"] is None for line in errors)
    assert ended.processing_status == "ended"
    assert (ended.request_counts.succeeded, ended.request_counts.expired) == (5, 5)
    assert sorted(r.result.type for r in results) == ["expired"] * 5 + ["succeeded"] * 5
    assert (served["processed"], served["expired"]) == (10, 10)


def test_a_share_of_batches_expire_the_same_way_for_a_seed() -> None:
    def expired(seed: int) -> list[bool]:
        with serve(Settings(expire_rate=0.5, seed=seed)) as base_url:
            client, _ = clients(base_url)
            ids = [submit(client, [chat_line(0, f"b{b}-0")]) for b in range(20)]
            return [wait_for(client, batch_id).status == "expired" for batch_id in ids]

    first = expired(seed=1)
    assert 4 <= sum(first) <= 16
    assert expired(seed=1) == first


def test_a_cancelled_batch_keeps_the_requests_done_before_the_cancel(clock: ManualClock) -> None:
    settings = Settings(processing_delay=10, cancelling_seconds=2)
    with serve(settings, clock=clock) as base_url:
        client, claude = clients(base_url)
        batch_id = submit(client, [chat_line(i) for i in range(10)])
        created = claude.messages.batches.create(requests=[message_request(i) for i in range(10)])
        clock.advance(3.5)
        assert client.batches.cancel(batch_id).status == "cancelling"
        assert claude.messages.batches.cancel(created.id).processing_status == "canceling"
        clock.advance(1)
        assert client.batches.retrieve(batch_id).status == "cancelling"
        clock.advance(20)
        batch = client.batches.retrieve(batch_id)
        ended = claude.messages.batches.retrieve(created.id)
        results = list(claude.messages.batches.results(created.id))
        with pytest.raises(openai.BadRequestError, match="Cannot cancel a batch with status"):
            client.batches.cancel(batch_id)
        with pytest.raises(anthropic.BadRequestError, match="cannot be canceled"):
            claude.messages.batches.cancel(created.id)
        output = lines_of(client, batch.output_file_id)
        served = stats(base_url)

    assert batch.status == "cancelled" and batch.cancelling_at and batch.cancelled_at
    assert sorted(line["custom_id"] for line in output) == ["req-0", "req-1", "req-2"]
    assert batch.error_file_id is None, "the unrun requests are in neither file"
    assert batch.request_counts and batch.request_counts.completed == 3
    assert ended.processing_status == "ended" and ended.cancel_initiated_at is not None
    assert (ended.request_counts.succeeded, ended.request_counts.canceled) == (3, 7)
    assert sorted(r.result.type for r in results) == ["canceled"] * 7 + ["succeeded"] * 3
    assert (served["cancels"], served["processed"], served["cancelled"]) == (2, 6, 14)
    assert served["refused"] == 2


def test_lists_page_newest_first_and_every_poll_is_counted() -> None:
    with serve() as base_url:
        client, claude = clients(base_url)
        openai_ids = [submit(client, [chat_line(0)]) for _ in range(5)]
        anthropic_ids = [
            claude.messages.batches.create(requests=[message_request(0)]).id for _ in range(5)
        ]
        first = client.batches.list(limit=2)
        every = [b.id for b in client.batches.list(limit=2)]  # the client pages on
        page = claude.messages.batches.list(limit=2)
        every_message = [b.id for b in claude.messages.batches.list(limit=2)]
        before = claude.messages.batches.list(limit=2, before_id=anthropic_ids[1])
        files = [f.id for f in client.files.list(purpose="batch")]
        served = stats(base_url)

    assert [b.id for b in first.data] == openai_ids[:2:-1] and first.has_more
    assert every == openai_ids[::-1]
    assert [b.id for b in page.data] == anthropic_ids[:2:-1] and page.has_more
    assert every_message == anthropic_ids[::-1]
    assert [b.id for b in before.data] == anthropic_ids[3:1:-1] and before.has_more
    assert len(files) == 5
    assert served["lists"] == 1 + 3 + 1 + 3 + 1 + 1
    assert served["polls"] == served["lists"]


def test_limits_and_malformed_input_are_refused_in_each_providers_shape() -> None:
    with serve() as base_url:
        client, claude = clients(base_url)
        lines = [chat_line(0, f"r{i}") for i in range(50_001)]
        with pytest.raises(openai.BadRequestError, match="at most 50,000"):
            client.files.create(file=("big.jsonl", jsonl(lines)), purpose="batch")
        requests = [message_request(0, f"r{i}") for i in range(100_001)]
        with pytest.raises(anthropic.BadRequestError, match="at most 100,000"):
            claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        with pytest.raises(anthropic.BadRequestError, match="custom_id"):
            claude.messages.batches.create(requests=[message_request(0, "no spaces allowed")])
        with pytest.raises(anthropic.BadRequestError, match="unique"):
            claude.messages.batches.create(requests=[message_request(0, "a")] * 2)
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch_missing")
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.batches.retrieve("msgbatch_missing")
        bad = [chat_line(0, "a"), chat_line(1, "a"), {**chat_line(2), "url": "/v1/embeddings"}]
        failed = wait_for(client, submit(client, [*bad, chat_line(3)]))
        served = stats(base_url)
    assert failed.status == "failed" and failed.errors and failed.errors.data
    assert [(e.code, e.line) for e in failed.errors.data] == [
        ("duplicate_custom_id", 2),
        ("mismatched_endpoint", 3),
    ]
    assert served["refused"] == 6 and served["uploads"] == 1 and served["processed"] == 0

    with serve(Settings(openai_max_bytes=1000, anthropic_max_bytes=1000)) as base_url:
        client, claude = clients(base_url)
        with pytest.raises(openai.BadRequestError, match="at most 1,000 bytes"):
            client.files.create(
                file=("x.jsonl", jsonl([chat_line(i) for i in range(20)])), purpose="batch"
            )
        with pytest.raises(anthropic.APIStatusError, match="at most 1,000 bytes") as refused:
            claude.messages.batches.create(requests=[message_request(i) for i in range(20)])
    assert refused.value.status_code == 413
    assert refused.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]


def test_the_provider_runs_as_its_own_process_on_the_real_clock() -> None:
    with serve_process(Settings(processing_delay=0.3, error_rate=0.5)) as base_url:
        client, _ = clients(base_url)
        batch = wait_for_seconds(client, submit(client, [chat_line(i) for i in range(20)]))
        served = stats(base_url)
    assert batch.status == "completed"
    assert served["submitted"] == served["processed"] == 20
    assert 0 < served["errored"] < 20


def wait_for_seconds(client: openai.OpenAI, batch_id: str) -> openai.types.Batch:
    deadline = time.monotonic() + 30
    while (batch := client.batches.retrieve(batch_id)).status != "completed":
        assert time.monotonic() < deadline, f"batch {batch_id} did not end: {batch.status}"
        time.sleep(0.05)
    return batch
