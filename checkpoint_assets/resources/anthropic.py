"""``AnthropicResource``: the ``anthropic`` package's client for a checkpointed function.

>>> from checkpoint_assets import AnthropicResource
>>> AnthropicResource(api_key="local", model="claude-haiku-4-5").request_defaults()
{'model': 'claude-haiku-4-5', 'max_tokens': 1024}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from pydantic import Field

from checkpoint_assets.resources.endpoint import EndpointResource

if TYPE_CHECKING:
    import anthropic

    from checkpoint_assets.resources.anthropic_batches import AnthropicBatches

# Retries of the batch API's own requests: create, list, poll, download. None of them is paid
# per token. Each is safe to repeat but create, which the engine finds by its tag first.
_BATCH_API_RETRIES = 5

__all__ = ["AnthropicResource"]


class AnthropicResource(EndpointResource):
    """Anthropic's Messages API, or a server that speaks it. Needs
    ``pip install "checkpoint-assets[anthropic]"``.

    The Messages API takes no sampling temperature; ``max_tokens`` is the request setting it
    adds to ``model`` (``request_defaults()``).

    A rate limit arrives as ``anthropic.RateLimitError`` (429), an overloaded API as
    ``anthropic.OverloadedError`` (529). With ``max_retries=0`` both reach the checkpointed
    asset, which pauses the shard instead of failing rows.

    Example::

        claude = AnthropicResource(
            api_key=dg.EnvVar("ANTHROPIC_API_KEY"), model="claude-haiku-4-5", max_tokens=16
        )

        async def route(batch: pl.DataFrame, claude: AnthropicResource) -> pl.DataFrame:
            reply = await claude.client().messages.create(
                messages=[{"role": "user", "content": text}], **claude.request_defaults()
            )
    """

    _package: ClassVar[str] = "anthropic"
    _client_classes: ClassVar[tuple[str, str]] = ("AsyncAnthropic", "Anthropic")
    _answer_settings: ClassVar[tuple[str, ...]] = ("max_tokens",)
    _default_endpoint: ClassVar[str] = "/v1/messages"

    base_url: str | None = Field(
        default=None,
        description="Base URL of the endpoint, without /v1; unset means Anthropic's API (or "
        "ANTHROPIC_BASE_URL). Usually dg.EnvVar('ANTHROPIC_BASE_URL') when set.",
    )
    api_key: str = Field(
        description="API key, sent as x-api-key. Usually dg.EnvVar('ANTHROPIC_API_KEY'); any "
        "value for a local server that checks none."
    )
    max_tokens: int = Field(
        default=1024,
        gt=0,
        description="Most tokens an answer may have, sent with every request "
        "(`request_defaults()`); the Messages API requires it.",
    )
    queued_requests: int | None = Field(
        default=None,
        gt=0,
        description="Provider batches: the most batch requests your workspace may have waiting "
        "in Anthropic's processing queue (the Message Batches limit of your tier). Shards "
        "submit no more than this between them. Unset, a 429 on create makes the shard wait "
        "for room and submit again.",
    )

    def client(self) -> anthropic.AsyncAnthropic:
        """The ``anthropic.AsyncAnthropic`` client of the running event loop: made once, then
        reused. Call it inside an ``async def`` function."""
        return cast("anthropic.AsyncAnthropic", self._loop_client())

    def sync_client(self) -> anthropic.Anthropic:
        """The ``anthropic.Anthropic`` client of this process, for a plain ``def`` function:
        made once, then shared by every thread."""
        return cast("anthropic.Anthropic", self._process_client())

    def _path(self, endpoint: str) -> str:
        if endpoint != self._default_endpoint:
            raise ValueError(
                f"AnthropicResource sends {self._default_endpoint} only, not {endpoint!r}: leave "
                "the endpoint unset, or use OpenAIResource for OpenAI's endpoints."
            )
        return endpoint

    def batch_provider(self, endpoint: str | None = None) -> AnthropicBatches:
        """Anthropic's Message Batches on this resource's endpoint, for provider batches: every
        request's ``params`` get ``request_defaults()`` (``model``, ``max_tokens``) where the
        body leaves them out. ``endpoint`` may only be ``/v1/messages`` (or None), the one API
        message batches run."""
        from checkpoint_assets.resources.anthropic_batches import ENDPOINT, AnthropicBatches

        if endpoint not in (None, ENDPOINT):
            raise ValueError(
                f"Anthropic's message batches run {ENDPOINT} only, not {endpoint!r}: leave the "
                "endpoint unset, or use OpenAIResource for OpenAI's endpoints."
            )
        client = self.sync_client().with_options(max_retries=_BATCH_API_RETRIES)
        return AnthropicBatches(
            client, self.request_defaults(), queued_requests=self.queued_requests
        )
