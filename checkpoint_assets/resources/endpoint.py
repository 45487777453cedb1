"""What the endpoint resources share: settings, one client per event loop, the optional package.

An async client (``AsyncOpenAI``, ``AsyncAnthropic``) belongs to the event loop it first sends
on. Its pooled connections fail with "Event loop is closed" once used from another loop. So
:meth:`EndpointResource.client` keeps one client per running event loop and per configuration.
It is made on first use and reused by every call on that loop, so the calls in flight share its
connections.

The clients of loops that have closed are released when the step that used the resource ends.
Their connections hold their loop, so each run's loop and sockets would otherwise stay for the
life of the process. They are not released on the next call: a client dropped while a loop runs
schedules its own close on that loop, where it fails.

The sync client serves plain ``def`` functions, whose calls run in threads. It is one per process
and configuration, as both packages' sync clients are thread-safe.

Every client paces its model requests by the key's budgets (``rate_limits.py``): the limits its
answers state, or ``requests_per_minute`` / ``tokens_per_minute`` for an endpoint that states
none. The clients of one key in a process share one pacer.

The flow:

1. ``client()`` / ``sync_client()``;
2. ``_cached``: look up by ``_connection()`` and the limits;
3. ``_require``: import the package, or say which extra installs it;
4. the package's class, on the package's HTTP client with the pacing hooks.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping
from types import ModuleType
from typing import Any, ClassVar, Final

import dagster as dg
from pydantic import Field

from checkpoint_assets.engine.calls import pacing
from checkpoint_assets.resources import peers, rate_limits

_Clients = dict[tuple[Any, ...], Any]
_LOOP_CLIENTS: Final[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Clients]] = (
    weakref.WeakKeyDictionary()
)
_PROCESS_CLIENTS: Final[_Clients] = {}
# One pacer per key and limits, per process, with the count of the processes sharing the key.
_PACERS: Final[dict[tuple[Any, ...], tuple[pacing.Pacer, peers.Peers | None]]] = {}
_LOCK: Final = threading.Lock()


class EndpointResource(dg.ConfigurableResource):
    """The settings and client handling of :class:`OpenAIResource` and :class:`AnthropicResource`.

    Subclasses name their package and its two client classes, declare ``base_url`` and
    ``api_key`` (whose conventions differ by provider), and name the request settings they add
    that change the answers.

    Pacing: a model request starts only when its estimated tokens (its text's bytes over 4, plus
    ``max_tokens``) and one request fit what the key has left. What is left comes from the
    rate-limit headers of every answer (OpenAI's ``x-ratelimit-*``, Anthropic's
    ``anthropic-ratelimit-*``, the IETF ``RateLimit`` fields). They state the key's budget, so
    shards that run at once share it without further setup. For a server that sends none (vLLM,
    a proxy), set ``requests_per_minute`` / ``tokens_per_minute``: the processes of one machine
    that call the key take equal shares, counted as they start and finish (``peers.py``). For
    shards on several machines, set ``shards_at_once``: each takes ``1 / shards_at_once``. With
    neither limit, calls are not paced, and the shard's concurrency adapts to the refusals.
    """

    _package: ClassVar[str]  # the optional package, also the name of the extra installing it
    _client_classes: ClassVar[tuple[str, str]]  # (async, sync) client classes of the package
    _answer_settings: ClassVar[tuple[str, ...]]  # fields sent with every request, besides model
    _default_endpoint: ClassVar[str]  # the API path of a request when none is named

    base_url: str | None
    api_key: str
    model: str = Field(description="The model named in every request (`request_defaults()`).")
    timeout_seconds: float = Field(
        default=60.0, gt=0, description="Seconds before one request fails with a timeout."
    )
    max_retries: int = Field(
        default=0,
        ge=0,
        description="Retries inside the client. Keep 0 so that rate limits and errors reach the "
        "checkpointed asset, which pauses the shard on a rate limit, adapts its concurrency "
        "and retries failed batches.",
    )
    requests_per_minute: int | None = Field(
        default=None,
        gt=0,
        description="The key's requests per minute, for an endpoint whose answers state no "
        "limits; shared by `shards_at_once` shards. Limits an answer states take precedence.",
    )
    tokens_per_minute: int | None = Field(
        default=None,
        gt=0,
        description="The key's tokens per minute (input and output), for an endpoint whose "
        "answers state no limits; shared by `shards_at_once` shards.",
    )
    shards_at_once: int | None = Field(
        default=None,
        ge=1,
        description="Shards that call the endpoint at once, each taking this share of "
        "`requests_per_minute` and `tokens_per_minute`: set it when they run on several "
        "machines (the limit of their Dagster pool). Unset, the processes of this machine "
        "that call the key are counted as they start and finish.",
    )

    def request_defaults(self) -> dict[str, Any]:
        """The keyword arguments every request takes from this resource: ``model``, and the
        request settings that are set (``max_tokens``, ``temperature``)."""
        settings = {name: getattr(self, name) for name in self._answer_settings}
        return {"model": self.model, **{k: v for k, v in settings.items() if v is not None}}

    def checkpoint_fingerprint(self) -> dict[str, Any]:
        """The settings that change the answers: the API, ``model`` and the request settings
        (unset ones as None). Never the key, the URL or the timeouts."""
        settings = {name: getattr(self, name) for name in self._answer_settings}
        return {"api": self._package, "model": self.model, **settings}

    def sender(self, endpoint: str | None = None) -> Callable[[Mapping[str, Any]], Awaitable[Any]]:
        """An ``async`` function that sends one request body to ``endpoint`` and returns the
        response body as a dict: the online way of ``provider_batch_asset``.

        ``endpoint`` is the API path (``/v1/chat/completions``; None: the resource's default).
        The body gets ``request_defaults()`` where it leaves them out, as in a provider batch.
        It goes through :meth:`client` (the running event loop's), so the key's pacing applies;
        an error status raises the client's exception (a 429 pauses the shard).
        """
        path = self._path(endpoint or self._default_endpoint)
        defaults = self.request_defaults()

        async def send(body: Mapping[str, Any]) -> Any:
            return await self._loop_client().post(path, cast_to=object, body={**defaults, **body})

        return send

    def _path(self, endpoint: str) -> str:
        """The client's path of ``endpoint``; ValueError when this API has no such endpoint."""
        raise NotImplementedError

    def _loop_client(self) -> Any:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            name = type(self).__name__
            raise RuntimeError(
                f"{name}.client() returns an asyncio client and needs a running event loop: "
                f"call it inside an `async def` function, or use {name}.sync_client() in a "
                "plain `def`"
            ) from None
        with _LOCK:
            return self._cached(_LOOP_CLIENTS.setdefault(loop, {}), self._client_classes[0])

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        """Release the clients of the event loops that have closed: the run's are done."""
        with _LOCK:
            released = [_LOOP_CLIENTS.pop(loop) for loop in list(_LOOP_CLIENTS) if loop.is_closed()]
        released.clear()  # outside the lock: a client's finalizer may run here

    def _process_client(self) -> Any:
        with _LOCK:
            return self._cached(_PROCESS_CLIENTS, self._client_classes[1], os.getpid())

    def _cached(self, clients: _Clients, class_name: str, *scope: Any) -> Any:
        connection = self._connection()
        key = (class_name, *scope, *sorted(connection.items()), *self._limits())
        client = clients.get(key)
        if client is None:
            package = _require(self._package, type(self).__name__)
            asynchronous = class_name == self._client_classes[0]
            hooks = rate_limits.Hooks(*self._pacer(), asynchronous=asynchronous)
            http = "DefaultAsyncHttpxClient" if asynchronous else "DefaultHttpxClient"
            http_client = getattr(package, http)(event_hooks=hooks.event_hooks)
            client = clients[key] = getattr(package, class_name)(
                **connection, http_client=http_client
            )
        return client

    def _limits(self) -> tuple[Any, ...]:
        return (self.requests_per_minute, self.tokens_per_minute, self.shards_at_once)

    def _pacer(self) -> tuple[pacing.Pacer, peers.Peers | None]:
        """The pacer of this key and these limits in this process (inside ``_LOCK``), and the
        count of the processes of this machine calling the key (None: ``shards_at_once`` says
        it)."""
        key = (self._package, self._address(), self.api_key, *self._limits())
        found = _PACERS.get(key)
        if found is None:
            pacer = pacing.Pacer()
            assumed = {"requests": self.requests_per_minute, "tokens": self.tokens_per_minute}
            per_minute = {k: float(v) for k, v in assumed.items() if v is not None}
            pacer.assume(per_minute, share=1 / (self.shards_at_once or 1))
            counted = None
            if self.shards_at_once is None:
                counted = peers.Peers(peers.directory_of(f"{self._address()}\n{self.api_key}"))
            found = _PACERS[key] = (pacer, counted)
        return found

    def _address(self) -> str | None:
        """Where the requests go: with the key, it names the limits shared (None: the API's
        default URL)."""
        return self.base_url

    def _connection(self) -> dict[str, Any]:
        """The client's constructor arguments: what makes two clients different."""
        return {
            "base_url": self.base_url,
            "api_key": self.api_key,
            "timeout": self.timeout_seconds,
            "max_retries": self.max_retries,
        }


def _require(package: str, resource: str) -> ModuleType:
    """Import the optional ``package``, or say which extra of checkpoint-assets installs it."""
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as e:
        if e.name != package:
            raise
        raise ModuleNotFoundError(
            f"{resource} needs the `{package}` package, which is not installed: "
            f'pip install "checkpoint-assets[{package}]"',
            name=package,
        ) from None
