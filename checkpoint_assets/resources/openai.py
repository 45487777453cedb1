"""``OpenAIResource``: the ``openai`` package's client for a checkpointed function.

>>> from checkpoint_assets import OpenAIResource
>>> OpenAIResource(api_key="local", model="gpt-4o-mini", temperature=0).request_defaults()
{'model': 'gpt-4o-mini', 'temperature': 0.0}
>>> OpenAIResource(api_key="local", model="gpt-4o-mini").checkpoint_fingerprint()
{'api': 'openai', 'model': 'gpt-4o-mini', 'max_tokens': None, 'temperature': None}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from pydantic import Field

from checkpoint_assets.engine.providers.submissions import Limits
from checkpoint_assets.resources.endpoint import EndpointResource

if TYPE_CHECKING:
    import openai

    from checkpoint_assets.resources.openai_compatible import CompatibleBatches

# Retries of the batch API's own requests: upload, create, poll, download. None of them is paid
# per token. Each is safe to repeat: create is found by its tag before it is sent again.
_BATCH_API_RETRIES = 5

__all__ = ["OpenAIResource"]


class OpenAIResource(EndpointResource):
    """An OpenAI-compatible endpoint: the OpenAI API, vLLM, Ollama, LiteLLM, any server that
    speaks its protocol. Needs ``pip install "checkpoint-assets[openai]"``.

    ``max_tokens`` is sent as ``max_tokens``, which compatible servers take; OpenAI's reasoning
    models want ``max_completion_tokens``: leave ``max_tokens`` unset and pass that yourself.

    Example::

        openai_chat = OpenAIResource(
            base_url=dg.EnvVar("OPENAI_BASE_URL"),
            api_key=dg.EnvVar("OPENAI_API_KEY"),
            model="gpt-4o-mini",
        )

        async def route(batch: pl.DataFrame, openai_chat: OpenAIResource) -> pl.DataFrame:
            reply = await openai_chat.client().chat.completions.create(
                messages=[{"role": "user", "content": text}], **openai_chat.request_defaults()
            )
    """

    _package: ClassVar[str] = "openai"
    _client_classes: ClassVar[tuple[str, str]] = ("AsyncOpenAI", "OpenAI")
    _answer_settings: ClassVar[tuple[str, ...]] = ("max_tokens", "temperature")
    _default_endpoint: ClassVar[str] = "/v1/chat/completions"

    base_url: str | None = Field(
        default=None,
        description="Base URL of the endpoint, ending in /v1; unset means the OpenAI API (or "
        "OPENAI_BASE_URL). Usually dg.EnvVar('OPENAI_BASE_URL').",
    )
    api_key: str = Field(
        description="API key, sent as a bearer token. Usually dg.EnvVar('OPENAI_API_KEY'); any "
        "value for a local server that checks none."
    )
    max_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Most tokens an answer may have, sent as max_tokens with every request "
        "(`request_defaults()`); unset leaves the endpoint's default.",
    )
    temperature: float | None = Field(
        default=None,
        ge=0,
        description="Sampling temperature sent with every request (`request_defaults()`); "
        "unset leaves the endpoint's default.",
    )
    enqueued_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Provider batches: the most input tokens your organization may have "
        "waiting in the batch queue for `model` (OpenAI's enqueued token limit of your tier, "
        "such as 2,000,000; on Azure, the batch deployment's). Shards submit no more than this "
        "between them. Unset, the limit is learned from the first refusal, which states it.",
    )

    batch_completion_window: str = Field(
        default="24h",
        description="Provider batches: the completion window each batch asks for. OpenAI takes "
        "24h only; an OpenAI-compatible batch API at base_url may take more, such as 7d.",
    )
    batch_metadata: bool = Field(
        default=True,
        description="Provider batches: tag each batch in its metadata, to find it again after a "
        "crash. false for a compatible batch API that drops or refuses metadata: a batch is "
        "then found by its input file's name.",
    )
    batch_max_requests: int | None = Field(
        default=None,
        gt=0,
        description="Provider batches: the most requests one input file may hold, where the "
        "batch API at base_url takes fewer than OpenAI's 50,000.",
    )
    batch_max_bytes: int | None = Field(
        default=None,
        gt=0,
        description="Provider batches: the most bytes one input file may hold, where the batch "
        "API at base_url takes fewer than OpenAI's 200 MB.",
    )

    def client(self) -> openai.AsyncOpenAI:
        """The ``openai.AsyncOpenAI`` client of the running event loop: made once, then reused.

        Call it inside an ``async def`` function.
        """
        return cast("openai.AsyncOpenAI", self._loop_client())

    def sync_client(self) -> openai.OpenAI:
        """The ``openai.OpenAI`` client of this process, for a plain ``def`` function: made once,
        then shared by every thread."""
        return cast("openai.OpenAI", self._process_client())

    def _path(self, endpoint: str) -> str:
        # The client's base URL ends in /v1: its paths are relative to it.
        if not endpoint.startswith("/v1/"):
            raise ValueError(
                f"OpenAI's endpoints are API paths that start with /v1/, such as "
                f"/v1/chat/completions or /v1/embeddings, not {endpoint!r}."
            )
        return endpoint.removeprefix("/v1/")

    def batch_provider(self, endpoint: str | None = None) -> CompatibleBatches:
        """OpenAI's Batch API on this resource's endpoint, for ``provider_batch_asset``: every
        request body goes to ``endpoint`` (default ``/v1/chat/completions``) with
        ``request_defaults()`` added where the body leaves them out. An OpenAI-compatible batch
        API takes its own ``batch_*`` settings (window, metadata, file limits)."""
        from checkpoint_assets.resources.openai_batches import DEFAULT_ENDPOINT, LIMITS
        from checkpoint_assets.resources.openai_compatible import CompatibleBatches

        client = self.sync_client().with_options(max_retries=_BATCH_API_RETRIES)
        limits = Limits(
            self.batch_max_requests or LIMITS.max_requests, self.batch_max_bytes or LIMITS.max_bytes
        )
        return CompatibleBatches(
            client,
            endpoint or DEFAULT_ENDPOINT,
            self.request_defaults(),
            limits,
            window=self.batch_completion_window,
            metadata=self.batch_metadata,
            enqueued_tokens=self.enqueued_tokens,
        )
