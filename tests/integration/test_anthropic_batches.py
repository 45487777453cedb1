"""Anthropic's Message Batches finding a batch again: one created by a run that stopped before
recording it is found by its requests' ``custom_id`` prefix, through the real ``anthropic``
client over HTTP against the local provider (``examples/llm_batch/provider.py``). What a shard's
run does through either provider's batch API is in ``test_provider_batches.py``.
"""

from __future__ import annotations

import time

import anthropic
import pytest

from checkpoint_assets.engine.providers.submissions import Request, custom_id
from checkpoint_assets.resources.anthropic_batches import (
    AnthropicBatches,
    SubmissionUndecidedError,
)
from examples.llm_batch.provider import Settings, serve
from examples.llm_batch.provider import stats as served


def _requests(tag: str, n: int) -> list[Request]:
    body = {"messages": [{"role": "user", "content": "hello"}]}
    return [Request(custom_id(tag, i), body) for i in range(n)]


def test_a_batch_created_but_never_recorded_is_found_by_its_custom_id_prefix() -> None:
    with serve(Settings(processing_delay=0.4)) as url:
        client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="local")
        api = AnthropicBatches(client, {"model": "m", "max_tokens": 8}, find_poll_seconds=0.1)
        since = time.time() - 1
        other = api.create(_requests("ca" + "1" * 32, 3), None, "ca" + "1" * 32)
        mine = api.create(_requests("ca" + "2" * 32, 5), None, "ca" + "2" * 32)
        newer = api.create(_requests("ca" + "3" * 32, 5), None, "ca" + "3" * 32)
        # Still processing, so nothing tells them apart yet: find waits for them to end.
        assert api.find("ca" + "2" * 32, since) == mine
        assert api.find("ca" + "1" * 32, since) == other
        assert api.find("ca" + "3" * 32, since) == newer
        assert api.find("ca" + "4" * 32, since) is None, "never created: none of them holds it"
        assert api.find("ca" + "1" * 32, time.time() + 60) is None, "created before the intent"
        assert served(url)["creates"] == 3


def test_find_stops_without_sending_anything_while_it_cannot_tell() -> None:
    with serve(Settings(processing_delay=60)) as url:
        client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="local")
        api = AnthropicBatches(client, {"model": "m", "max_tokens": 8}, find_wait_seconds=0.3)
        api.find_poll_seconds = 0.1
        since = time.time() - 1
        running = api.create(_requests("ca" + "1" * 32, 3), None, "ca" + "1" * 32)
        with pytest.raises(SubmissionUndecidedError, match=running) as undecided:
            api.find("ca" + "2" * 32, since)
        assert "Nothing was submitted again" in str(undecided.value)
        assert served(url)["creates"] == 1
