"""``AzureOpenAIResource``: OpenAI's models on Azure, through the ``openai`` package's
``AzureOpenAI`` and ``AsyncAzureOpenAI`` clients.

Azure names a *deployment* where OpenAI names a model: every request's ``model`` is the
deployment's name, and the client sends it to ``/openai/deployments/{deployment}/...`` with the
``api-version`` query parameter. Online requests go to ``deployment`` (a Standard or Global
Standard deployment); provider batches go to ``batch_deployment`` (a Global Batch or Data Zone
Batch deployment, which only the Batch API reaches).

Azure's Batch API is OpenAI's (``/openai/files``, ``/openai/batches``): the adapter is
``OpenAIBatches`` with Azure's endpoint paths (``/chat/completions``) and limits
(:class:`AzureOpenAIBatches`), and the ``batch_*`` settings of an OpenAI-compatible API.
Azure bounds the input tokens enqueued per batch deployment: a batch past it fails with
``token_limit_exceeded``, as OpenAI's, and waits for room the same way (``enqueued_tokens``, the
deployment's limit, when known).

>>> r = AzureOpenAIResource(azure_endpoint="https://example.openai.azure.com",
...     api_key="local", deployment="gpt-4o-mini-std", model="gpt-4o-mini")
>>> r.request_defaults()
{'model': 'gpt-4o-mini-std'}
>>> r.checkpoint_fingerprint()
{'api': 'azure_openai', 'model': 'gpt-4o-mini', 'max_tokens': None, 'temperature': None}
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, ClassVar, Final

from pydantic import Field

from checkpoint_assets.engine.providers.submissions import Limits
from checkpoint_assets.resources.openai import _BATCH_API_RETRIES, OpenAIResource
from checkpoint_assets.resources.openai_compatible import CompatibleBatches

__all__ = ["AzureOpenAIBatches", "AzureOpenAIResource"]

# Azure's documented limits of one batch input file: 100,000 requests and 200 MB.
LIMITS: Final = Limits(max_requests=100_000, max_bytes=200 * 1000 * 1000)
# The generally available api-version that has the Batch API.
API_VERSION: Final = "2024-10-21"
# Azure's endpoint paths: those OpenAI's client sends to a deployment, without OpenAI's /v1.
_ENDPOINTS: Final = ("/chat/completions", "/embeddings", "/completions")


class AzureOpenAIBatches(CompatibleBatches):
    """Azure OpenAI's Batch API: OpenAI's, under its own name and limits. Each request's
    ``model`` is the batch deployment's name (``defaults``)."""

    name = "azure_openai"


class AzureOpenAIResource(OpenAIResource):
    """OpenAI's models deployed on Azure OpenAI (or Azure AI Foundry). Needs
    ``pip install "checkpoint-assets[openai]"``: the ``openai`` package has Azure's clients.

    Give the key by reference (``dg.EnvVar``), or leave it empty and name a Microsoft Entra ID
    token provider with ``token_provider``.

    Example::

        azure_chat = AzureOpenAIResource(
            azure_endpoint=dg.EnvVar("AZURE_OPENAI_ENDPOINT"),
            api_key=dg.EnvVar("AZURE_OPENAI_API_KEY"),
            deployment="gpt-4o-mini",            # Standard: online requests
            batch_deployment="gpt-4o-mini-batch",  # Global Batch: provider batches
            model="gpt-4o-mini",
        )
    """

    _client_classes: ClassVar[tuple[str, str]] = ("AsyncAzureOpenAI", "AzureOpenAI")
    _default_endpoint: ClassVar[str] = "/chat/completions"

    azure_endpoint: str | None = Field(
        default=None,
        description="The resource's endpoint, such as https://NAME.openai.azure.com. Usually "
        "dg.EnvVar('AZURE_OPENAI_ENDPOINT').",
    )
    base_url: str | None = Field(
        default=None,
        description="Instead of azure_endpoint: a base URL ending in /openai, for a gateway in "
        "front of Azure (API Management). Leave unset with azure_endpoint.",
    )
    api_key: str = Field(
        default="",
        description="The resource's key, sent as the api-key header. Usually "
        "dg.EnvVar('AZURE_OPENAI_API_KEY'). Empty: token_provider signs every request.",
    )
    token_provider: str | None = Field(
        default=None,
        description="Microsoft Entra ID instead of a key: 'module:function', a function of no "
        "argument that returns a bearer token, called before every request (such as "
        "azure.identity's get_bearer_token_provider(DefaultAzureCredential(), "
        "'https://cognitiveservices.azure.com/.default')).",
    )
    api_version: str = Field(
        default=API_VERSION,
        description="The api-version query parameter of every request.",
    )
    deployment: str = Field(
        description="The deployment online requests go to (a Standard or Global Standard "
        "deployment): the model every request names."
    )
    batch_deployment: str | None = Field(
        default=None,
        description="The Global Batch (or Data Zone Batch) deployment provider batches go to; "
        "unset: deployment. Its enqueued-token limit (`enqueued_tokens`) bounds what may "
        "wait in its queue.",
    )
    model: str = Field(
        default="",
        description="The model the deployments run, such as gpt-4o-mini: in the checkpoint's "
        "fingerprint and the budget's prices. Empty: the deployment's name stands for it.",
    )

    def request_defaults(self) -> dict[str, Any]:
        """``model`` (the online deployment's name) and the request settings that are set."""
        return {**super().request_defaults(), "model": self.deployment}

    def checkpoint_fingerprint(self) -> dict[str, Any]:
        """The settings that change the answers: the API, ``model`` (or the deployment's name)
        and the request settings. Never the key, the endpoint or the api-version."""
        model = self.model or self.batch_deployment or self.deployment
        return {**super().checkpoint_fingerprint(), "api": "azure_openai", "model": model}

    def batch_provider(self, endpoint: str | None = None) -> AzureOpenAIBatches:
        """Azure's Batch API on ``batch_deployment``, for ``provider_batch_asset``: every
        request body goes to ``endpoint`` (default ``/chat/completions``) with
        ``request_defaults()`` added, ``model`` being the batch deployment."""
        path = self._path(endpoint or self._default_endpoint)
        defaults = {**self.request_defaults(), "model": self.batch_deployment or self.deployment}
        client = self.sync_client().with_options(max_retries=_BATCH_API_RETRIES)
        limits = Limits(
            self.batch_max_requests or LIMITS.max_requests, self.batch_max_bytes or LIMITS.max_bytes
        )
        return AzureOpenAIBatches(
            client,
            path,
            defaults,
            limits,
            window=self.batch_completion_window,
            metadata=self.batch_metadata,
            enqueued_tokens=self.enqueued_tokens,
        )

    def _path(self, endpoint: str) -> str:
        # OpenAI's paths are taken too: /v1/chat/completions is /chat/completions on Azure.
        path = endpoint.removeprefix("/v1")
        if path not in _ENDPOINTS:
            raise ValueError(
                f"Azure OpenAI's deployments take {', '.join(_ENDPOINTS)}, not {endpoint!r}."
            )
        return path

    def _address(self) -> str | None:
        return self.azure_endpoint or self.base_url

    def _connection(self) -> dict[str, Any]:
        if (self.azure_endpoint is None) == (self.base_url is None):
            raise ValueError(
                "AzureOpenAIResource needs azure_endpoint (https://NAME.openai.azure.com), or "
                "base_url for a gateway: set exactly one."
            )
        if bool(self.api_key) == (self.token_provider is not None):
            raise ValueError(
                "AzureOpenAIResource needs api_key (usually dg.EnvVar('AZURE_OPENAI_API_KEY')) "
                "or token_provider (Microsoft Entra ID): set exactly one."
            )
        where = {"azure_endpoint": self.azure_endpoint} if self.azure_endpoint else {}
        credential: dict[str, Any] = {"api_key": self.api_key}
        if self.token_provider is not None:
            credential = {"azure_ad_token_provider": _function(self.token_provider)}
        return {
            **(where or {"base_url": self.base_url}),
            **credential,
            "api_version": self.api_version,
            "timeout": self.timeout_seconds,
            "max_retries": self.max_retries,
        }


def _function(reference: str) -> Callable[[], str]:
    """The function ``module:name`` names, or a ValueError saying what to write."""
    module_name, _, name = reference.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), name) if name else None
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"token_provider {reference!r} names no function ({e}): write 'module:function', "
            "a module on the path and a function of no argument that returns a token."
        ) from None
    if not callable(found):
        raise ValueError(
            f"token_provider {reference!r} is no function: write 'module:function', a function "
            "of no argument that returns a token."
        )
    return found  # type: ignore[no-any-return]
