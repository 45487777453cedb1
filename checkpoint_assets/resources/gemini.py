"""``GeminiResource``: the ``google-genai`` client, on the Gemini API or on Vertex AI.

>>> from checkpoint_assets import GeminiResource
>>> GeminiResource(api_key="local", model="gemini-2.5-flash", temperature=0).request_defaults()
{'temperature': 0.0}
>>> GeminiResource(api_key="k", model="gemini-2.5-flash", max_output_tokens=8).request_defaults()
{'max_output_tokens': 8}
>>> GeminiResource(api_key="local", model="gemini-2.5-flash").checkpoint_fingerprint()
{'api': 'gemini', 'model': 'gemini-2.5-flash', 'max_output_tokens': None, 'temperature': None}
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, cast

import dagster as dg
from pydantic import Field

from checkpoint_assets.resources.gemini_batches import retry_delay_seconds

if TYPE_CHECKING:
    from google import genai

    from checkpoint_assets.resources.gemini_batches import GeminiBatches
    from checkpoint_assets.resources.vertex_batches import VertexBatches

__all__ = ["GeminiRateLimitedError", "GeminiResource"]

# Retries of the batch API's own requests: upload, create, poll, list, download. None of them
# is paid per token. Each is safe to repeat: a create is found by its tag before it is sent again.
_BATCH_API_RETRIES: Final = 5
_LOCK: Final = threading.Lock()
_PROCESS_CLIENTS: Final[dict[tuple[Any, ...], Any]] = {}
_LOOP_CLIENTS: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


class _Refusal:
    """What ``engine/calls/refusals.py`` reads of a refused request: its status and headers."""

    def __init__(self, seconds: float | None) -> None:
        self.status_code = 429
        self.headers = {} if seconds is None else {"retry-after": f"{seconds:g}"}


class GeminiRateLimitedError(Exception):
    """Gemini answered 429 ``RESOURCE_EXHAUSTED``; ``seconds`` is its ``retryDelay``, when it
    gave one. The checkpointed asset pauses the shard that long, then sends the request again;
    it is no failed row."""

    def __init__(self, seconds: float | None, message: str) -> None:
        super().__init__(message)
        self.seconds = seconds
        self.response = _Refusal(seconds)


class GeminiResource(dg.ConfigurableResource):
    """Google's Gemini models through the ``google-genai`` client, on the Gemini API (an API
    key) or on Vertex AI (``vertexai=True``: a project, a location and application default
    credentials). Needs ``pip install "checkpoint-assets[gemini]"``.

    ``provider_batch_asset`` sends each row's body, a REST ``GenerateContentRequest``
    (``{"contents": [...], "generationConfig": {...}}``), online with ``generate_content``
    (``sender()``) or in batches (``batch_provider()``: Batch Mode on the Gemini API, batch
    prediction on Vertex AI, through ``gcs_prefix``).

    Example::

        gemini = GeminiResource(api_key=dg.EnvVar("GEMINI_API_KEY"), model="gemini-2.5-flash")
        vertex = GeminiResource(
            vertexai=True,
            project="my-project",
            location="us-central1",
            gcs_prefix="gs://my-bucket/batches",
            model="gemini-2.5-flash",
        )
    """

    model: str = Field(description="The model of every request, such as gemini-2.5-flash.")
    api_key: str | None = Field(
        default=None,
        description="Gemini API key. Usually dg.EnvVar('GEMINI_API_KEY'); unset on Vertex AI, "
        "which uses application default credentials.",
    )
    vertexai: bool = Field(
        default=False,
        description="Send to Vertex AI (project, location, application default credentials) "
        "instead of the Gemini API.",
    )
    project: str | None = Field(
        default=None,
        description="Vertex AI: the Google Cloud project; unset takes GOOGLE_CLOUD_PROJECT or "
        "the credentials' project.",
    )
    location: str | None = Field(
        default=None,
        description="Vertex AI: the region, such as us-central1; unset takes "
        "GOOGLE_CLOUD_LOCATION.",
    )
    gcs_prefix: str | None = Field(
        default=None,
        description="Vertex AI batches: the gs:// prefix their input and output files go under "
        "(the service agent must read and write it).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Vertex AI batches: options of the gcsfs file system that writes and reads "
        "them (its default uses application default credentials).",
    )
    base_url: str | None = Field(
        default=None, description="Another endpoint of the same API (a proxy, a local test server)."
    )
    max_output_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Most tokens an answer may have, added to every request's generationConfig "
        "(`request_defaults()`); unset leaves the model's default.",
    )
    temperature: float | None = Field(
        default=None,
        ge=0,
        description="Sampling temperature added to every request's generationConfig "
        "(`request_defaults()`); unset leaves the model's default.",
    )
    timeout_seconds: float = Field(
        default=60.0, gt=0, description="Seconds before one request fails with a timeout."
    )
    inline_max_bytes: int | None = Field(
        default=None,
        gt=0,
        description="Gemini API batches: submissions smaller than this go inline in the create; "
        "larger ones go as a JSONL file (unset: Google's limit, 20 MB).",
    )

    concurrent_jobs: int | None = Field(
        default=None,
        gt=0,
        description="Provider batches: the most batch jobs of `model` your project may have at "
        "once (100 on the Gemini API; Vertex AI's quota of concurrent batch prediction jobs). "
        "Shards keep no more jobs than this between them. Unset, a 429 on create makes the "
        "shard wait for room and submit again.",
    )

    def request_defaults(self) -> dict[str, Any]:
        """The generation settings every request takes from this resource, as the SDK names
        them: ``max_output_tokens`` and ``temperature`` when set. They go into each body's
        ``generationConfig`` where it leaves them out."""
        settings = {"max_output_tokens": self.max_output_tokens, "temperature": self.temperature}
        return {k: v for k, v in settings.items() if v is not None}

    def checkpoint_fingerprint(self) -> dict[str, Any]:
        """The settings that change the answers: the API, ``model`` and the request settings
        (unset ones as None). Never the key, the project or the URL."""
        return {
            "api": "gemini",
            "model": self.model,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
        }

    def client(self) -> genai.Client:
        """The ``google.genai.Client`` of this process, made once and shared by every thread.
        Its ``client().aio`` is the asyncio side."""
        return self._process_client(0)

    def _process_client(self, retries: int) -> genai.Client:
        key = (*sorted(self._connection().items()), retries)
        with _LOCK:
            found = _PROCESS_CLIENTS.get(key)
            if found is None:
                found = _PROCESS_CLIENTS[key] = self._new_client(retries)
            return found  # type: ignore[no-any-return]

    def _loop_client(self) -> genai.Client:
        """A client of the running event loop: its ``aio`` connections belong to that loop."""
        loop = asyncio.get_running_loop()
        key = tuple(sorted(self._connection().items()))
        with _LOCK:
            clients = _LOOP_CLIENTS.setdefault(loop, {})
            found = clients.get(key)
            if found is None:
                found = clients[key] = self._new_client(0)
            return found  # type: ignore[no-any-return]

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        """Release the clients of the event loops that have closed: the run's are done."""
        with _LOCK:
            released = [_LOOP_CLIENTS.pop(loop) for loop in list(_LOOP_CLIENTS) if loop.is_closed()]
        released.clear()

    def _connection(self) -> dict[str, Any]:
        return {
            "vertexai": self.vertexai,
            "api_key": self.api_key,
            "project": self.project,
            "location": self.location,
            "base_url": self.base_url,
            "timeout": self.timeout_seconds,
        }

    def _new_client(self, retries: int) -> genai.Client:
        package = _require()
        from google.genai import types

        retry = types.HttpRetryOptions(attempts=retries + 1) if retries else None
        options = types.HttpOptions(
            base_url=self.base_url,
            timeout=int(self.timeout_seconds * 1000),
            retry_options=retry,
        )
        if self.vertexai:
            vertex = package.Client(
                vertexai=True, project=self.project, location=self.location, http_options=options
            )
            return cast("genai.Client", vertex)
        if not self.api_key:
            raise ValueError(
                "GeminiResource needs api_key for the Gemini API (usually "
                "dg.EnvVar('GEMINI_API_KEY')), or vertexai=True with a project and a location."
            )
        return cast("genai.Client", package.Client(api_key=self.api_key, http_options=options))

    def sender(self, endpoint: str | None = None) -> Callable[[Mapping[str, Any]], Awaitable[Any]]:
        """An ``async`` function that sends one body with ``generate_content`` and returns the
        response as the API's JSON: the online way of ``provider_batch_asset``.

        The body gets ``request_defaults()`` in its ``generationConfig`` where it leaves them
        out, as in a batch. A 429 ``RESOURCE_EXHAUSTED`` raises
        :class:`GeminiRateLimitedError` with its ``retryDelay``: the shard pauses that long.
        """
        from checkpoint_assets.resources.gemini_batches import (
            response_body,
            sdk_arguments,
            with_defaults,
        )

        _check_endpoint(endpoint)
        defaults = self.request_defaults()

        async def send(body: Mapping[str, Any]) -> Any:
            arguments = sdk_arguments(with_defaults(body, defaults))
            client = self._loop_client()
            try:
                response = await client.aio.models.generate_content(model=self.model, **arguments)
            except Exception as e:
                if getattr(e, "code", None) == 429:
                    seconds = retry_delay_seconds(getattr(e, "details", None))
                    raise GeminiRateLimitedError(seconds, str(e)) from e
                raise
            return response_body(response)

        return send

    def batch_provider(self, endpoint: str | None = None) -> GeminiBatches | VertexBatches:
        """Gemini's batch API for ``provider_batch_asset``: Batch Mode on the Gemini API, or
        Vertex AI batch prediction (``vertexai=True``) through ``gcs_prefix``."""
        from checkpoint_assets.resources import gemini_batches as gb

        _check_endpoint(endpoint)
        client = self._process_client(_BATCH_API_RETRIES)
        if not self.vertexai:
            inline = self.inline_max_bytes or gb.INLINE_MAX_BYTES
            return gb.GeminiBatches(
                client,
                self.model,
                self.request_defaults(),
                inline_max_bytes=inline,
                concurrent_jobs=self.concurrent_jobs,
            )
        if self.gcs_prefix is None or not self.gcs_prefix.startswith("gs://"):
            raise ValueError(
                f"GeminiResource(vertexai=True) sends batches through Cloud Storage, and its "
                f"gcs_prefix is {self.gcs_prefix!r}: set gcs_prefix to a gs:// prefix that Vertex "
                "AI's service agent may read and write, such as gs://my-bucket/batches. "
                "BigQuery tables (bq://) are not taken: the rows come from the asset."
            )
        # gcsfs's plain file system: its default one asks each bucket's type over gRPC first,
        # which plain JSONL files do not need.
        from gcsfs.core import GCSFileSystem

        from checkpoint_assets.resources.vertex_batches import VertexBatches

        filesystem = GCSFileSystem(**self.storage_options)
        return VertexBatches(
            client,
            self.model,
            self.gcs_prefix,
            filesystem,
            self.request_defaults(),
            concurrent_jobs=self.concurrent_jobs,
        )


def _check_endpoint(endpoint: str | None) -> None:
    if endpoint not in (None, "generateContent"):
        raise ValueError(
            f"GeminiResource sends generateContent requests only, not {endpoint!r}: leave the "
            "endpoint unset."
        )


def _require() -> Any:
    """Import ``google.genai``, or say which extra of checkpoint-assets installs it."""
    try:
        return importlib.import_module("google.genai")
    except ModuleNotFoundError as e:
        if e.name not in ("google", "google.genai"):
            raise
        raise ModuleNotFoundError(
            "GeminiResource needs the `google-genai` package, which is not installed: "
            'pip install "checkpoint-assets[gemini]"',
            name="google.genai",
        ) from None
