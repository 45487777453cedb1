"""The local provider's batches without HTTP: when each request ends, what it answers, and what
state a batch is in at any moment.

A batch is a list of requests and the moment it was created; its state is a function of the
clock, worked out when someone looks (no background thread):

* ``validating`` up to ``validating_seconds`` after creation (at least at the moment of creation,
  so a create's answer always says so), then ``failed`` if its input had problems;
* ``in_progress`` for ``processing_delay`` seconds, the requests finishing one after another at
  an even pace, in their order;
* ``finalizing`` for ``finalizing_seconds``, then ``completed``.

A batch drawn to expire (a share ``expire_rate`` of batches) works at a pace that would need
twice ``expire_after`` seconds: it ends ``expired`` ``expire_after`` seconds after creation (not
before validation ends) with the first half of its requests done, none when ``expire_after``
is 0. A cancelled batch keeps the requests done before the cancel, shows ``cancelling`` for
``cancelling_seconds`` (at least at the cancel itself), then ``cancelled``.

Each request done gets its answer when it is first seen done: a chat completion, embeddings or
an Anthropic message, deterministic from the prompt (the support-ticket department the demo's
rules pick, with whitespace-token usage, as ``examples.llm_openai.server`` answers), or a
per-request error: ``400`` for a malformed body, ``500`` for a share ``error_rate`` of requests.
Which request fails is a hash of ``(seed, custom_id, attempt)``, where ``attempt`` counts how
often that ``custom_id`` was answered before, so runs are reproducible and a retried request
eventually succeeds. Which batch expires is a hash of ``(seed, API, n)`` for the API's n-th batch
(:func:`expires`), so a test knows which of its batches will (whatever their ids).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import time
from collections import Counter
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from examples.llm_openai.server import classify

__all__ = ["Answerer", "Job", "ManualClock", "Outcome", "Phase", "Settings", "expires"]

#: The endpoints an OpenAI batch may name here, and Anthropic's.
CHAT: Final = "/v1/chat/completions"
EMBEDDINGS: Final = "/v1/embeddings"
MESSAGES: Final = "/v1/messages"


@dataclass(frozen=True)
class Settings:
    """How the provider behaves; see the module docstring.

    Attributes:
        processing_delay: seconds a batch is ``in_progress``, its requests ending evenly.
        validating_seconds: seconds a batch is ``validating`` first.
        finalizing_seconds: seconds a batch is ``finalizing`` after its last request.
        cancelling_seconds: seconds a cancelled batch shows ``cancelling``.
        error_rate: share of requests that fail with ``500`` (drawn per ``custom_id``).
        expire_rate: share of batches that expire (1 for all).
        expire_after: seconds after creation an expiring batch expires.
        seed: changes which requests fail and which batches expire, not how many.
        openai_max_requests, openai_max_bytes: the most requests (lines) and bytes a batch's
            input file may hold: 50,000 and 200 MB, as OpenAI's Batch API.
        anthropic_max_requests, anthropic_max_bytes: the most requests and bytes (of the
            create's body) in one message batch: 100,000 and 256 MB, as Anthropic's.
        openai_enqueued_tokens: the most input tokens of one model that OpenAI batches not
            ended may hold (0: no limit); past it a batch is created and fails validation with
            ``token_limit_exceeded``, as OpenAI's. Tokens are the prompt's bytes over 4.
        anthropic_queued_requests: the most requests message batches still processing may hold
            (0: no limit); past it a create is refused with 429, as Anthropic's.
        queue_retry_after: the seconds that 429 asks to wait (``retry-after``).
        refuse_creates: the first creates of batches refused for want of queue room, whatever
            the queue holds, each as its provider refuses one past its queue (OpenAI:
            ``token_limit_exceeded``; Anthropic, Gemini, Vertex: 429; Bedrock:
            ``ServiceQuotaExceededException``). Every create request counts, a client's own
            retries too.
    """

    processing_delay: float = 0.0
    validating_seconds: float = 0.0
    finalizing_seconds: float = 0.0
    cancelling_seconds: float = 0.0
    error_rate: float = 0.0
    expire_rate: float = 0.0
    expire_after: float = 0.0
    seed: int = 0
    openai_max_requests: int = 50_000
    openai_max_bytes: int = 200_000_000
    anthropic_max_requests: int = 100_000
    anthropic_max_bytes: int = 256_000_000
    openai_enqueued_tokens: int = 0
    anthropic_queued_requests: int = 0
    queue_retry_after: float = 1.0
    refuse_creates: int = 0

    def __post_init__(self) -> None:
        for name in ("error_rate", "expire_rate"):
            rate = getattr(self, name)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {rate}")
        for name in (
            "processing_delay",
            "validating_seconds",
            "finalizing_seconds",
            "cancelling_seconds",
            "expire_after",
            "queue_retry_after",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        for name in (
            "openai_max_requests",
            "openai_max_bytes",
            "anthropic_max_requests",
            "anthropic_max_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("openai_enqueued_tokens", "anthropic_queued_requests", "refuse_creates"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {getattr(self, name)}")

    def refuses(self, counts: MutableMapping[str, int]) -> bool:
        """Whether a create is refused by ``refuse_creates``: counted in ``counts`` under
        ``queue_refused`` when it is."""
        if counts.get("queue_refused", 0) >= self.refuse_creates:
            return False
        counts["queue_refused"] = counts.get("queue_refused", 0) + 1
        return True

    def argv(self) -> list[str]:
        """These settings as options of ``python -m examples.llm_batch.provider``."""
        return [
            f"--{name.replace('_', '-')}={getattr(self, name)}"
            for name in self.__dataclass_fields__
        ]


class ManualClock:
    """A clock that moves only when told, for tests that walk a batch through its states.

    >>> clock = ManualClock(1000.0)
    >>> clock.advance(2.5)
    >>> clock()
    1002.5
    """

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Phase(enum.StrEnum):
    """A batch's state, in OpenAI's words (Anthropic's are derived from them)."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


ENDED: Final = frozenset({Phase.FAILED, Phase.COMPLETED, Phase.EXPIRED, Phase.CANCELLED})
CANCELLABLE: Final = frozenset({Phase.VALIDATING, Phase.IN_PROGRESS, Phase.FINALIZING})


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's answer: ``status`` 200 and the response body, or an error's status and
    its ``(type, message)``; ``tokens`` = (input, output) of an answer."""

    custom_id: str
    status: int
    body: dict[str, Any] | None = None
    error: tuple[str, str] | None = None
    tokens: tuple[int, int] = (0, 0)


@dataclass
class Job:
    """One batch of either API: its requests, when it was created, and what was done so far.

    ``problems`` are the validation errors of an OpenAI input file (``code``, ``message``,
    ``line``): such a batch ends ``failed`` without running any request.
    """

    id: str
    endpoint: str
    requests: Sequence[tuple[str, Any]]  # (custom_id, body or params)
    created: float
    settings: Settings
    expiring: bool = False
    problems: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, str] | None = None
    input_file_id: str = ""
    cancelled_at: float | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # "output"/"error" -> file id, once ended
    settled: bool = False  # whether its end was counted and ``on_end`` called
    enqueued: int = 0  # the input tokens it holds in the queue while it has not ended
    on_end: Callable[[Job, Phase], None] | None = None  # what its API does once it has ended

    def phase(self, now: float) -> Phase:
        """The state at ``now``."""
        s, elapsed = self.settings, now - self.created
        if self.cancelled_at is not None:
            ends = self.cancelled_at + s.cancelling_seconds
            return Phase.CANCELLING if now <= ends else Phase.CANCELLED
        if elapsed <= s.validating_seconds:
            return Phase.VALIDATING
        if self.problems:
            return Phase.FAILED
        if self.expiring:
            return Phase.IN_PROGRESS if elapsed < self._expiry() else Phase.EXPIRED
        if elapsed < s.validating_seconds + s.processing_delay:
            return Phase.IN_PROGRESS
        if elapsed < s.validating_seconds + s.processing_delay + s.finalizing_seconds:
            return Phase.FINALIZING
        return Phase.COMPLETED

    def ended_at(self) -> float:
        """When the batch reached the state it ends in (meaningful once it has)."""
        s = self.settings
        if self.cancelled_at is not None:
            return self.cancelled_at + s.cancelling_seconds
        if self.problems:
            return self.created + s.validating_seconds
        if self.expiring:
            return self.created + self._expiry()
        return self.created + s.validating_seconds + s.processing_delay + s.finalizing_seconds

    def done(self, now: float) -> int:
        """How many requests (the first ones, in order) have their answer at ``now``."""
        if self.cancelled_at is not None:
            now = min(now, self.cancelled_at)
        s, elapsed = self.settings, now - self.created
        if self.problems or elapsed <= s.validating_seconds:
            return 0
        n = len(self.requests)
        if self.expiring:
            target, span = n // 2, self._expiry() - s.validating_seconds
            if span <= 0:
                return 0
        else:
            target, span = n, s.processing_delay
        if span <= 0:
            return target
        return min(target, math.floor(target * (elapsed - s.validating_seconds) / span))

    def advance(self, now: float, answerer: Answerer) -> None:
        """Answer the requests done by ``now`` that have no outcome yet."""
        for custom_id, body in self.requests[len(self.outcomes) : self.done(now)]:
            self.outcomes.append(answerer.answer(self.endpoint, custom_id, body))

    def _expiry(self) -> float:
        return max(self.settings.expire_after, self.settings.validating_seconds)


class Answerer:
    """Answers requests, deterministically, and draws the requests that fail (see the module
    docstring). Counts what it answered in ``counts``."""

    def __init__(self, settings: Settings, counts: Counter[str]) -> None:
        self.settings = settings
        self.counts = counts
        self._attempts: dict[bytes, int] = {}

    def answer(self, endpoint: str, custom_id: str, body: Any) -> Outcome:
        """The outcome of one request to ``endpoint``."""
        try:
            outcome = _ANSWERS[endpoint](custom_id, body)
        except (AttributeError, KeyError, TypeError, ValueError):
            outcome = Outcome(custom_id, 400, error=("invalid_request_error", _BAD[endpoint]))
        else:
            if self._draw(b"request\x00" + custom_id.encode()) < self.settings.error_rate:
                error = ("server_error", "The server had an error while processing your request.")
                outcome = Outcome(custom_id, 500, error=error)
        self.counts["processed"] += 1
        if outcome.status == 200:
            self.counts["succeeded"] += 1
            self.counts["input_tokens"] += outcome.tokens[0]
            self.counts["output_tokens"] += outcome.tokens[1]
        else:
            self.counts["errored"] += 1
        return outcome

    def _draw(self, key: bytes) -> float:
        """A number in [0, 1) fixed by the seed, the key and how often the key was drawn."""
        digest = hashlib.blake2b(key, digest_size=16).digest()
        attempt = self._attempts.get(digest, 0)
        self._attempts[digest] = attempt + 1
        return _fate(self.settings.seed, b"%d\x00" % attempt + digest)


def expires(settings: Settings, api: str, number: int) -> bool:
    """Whether the ``number``-th batch (from 1) created through ``api`` (``"openai"``,
    ``"anthropic"``) expires.

    >>> [expires(Settings(expire_rate=0.5, seed=3), "openai", n) for n in (1, 2, 3)]
    [False, True, True]
    """
    return (
        _fate(settings.seed, b"batch\x00%s\x00%d" % (api.encode(), number)) < settings.expire_rate
    )


def _fate(seed: int, key: bytes) -> float:
    """A number in [0, 1) fixed by the seed and the key."""
    digest = hashlib.blake2b(b"%d\x00" % seed + key, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


# -- the answers ---------------------------------------------------------------------------------
def _tokens(text: str) -> int:
    return len(text.split())


def _text(content: Any) -> str:
    """The text of a message's content: a string or a list of text parts (either API's)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = [p["text"] for p in content if p.get("type") == "text"]
        if len(parts) == len(content) and all(isinstance(t, str) for t in parts):
            return "\n".join(parts)
    raise TypeError("content must be a string or a list of text parts")


def _chat(custom_id: str, body: Any) -> Outcome:
    model, messages = body["model"], body["messages"]
    if not isinstance(model, str) or not messages:
        raise TypeError
    texts = [_text(m["content"]) for m in messages]
    users = [t for m, t in zip(messages, texts, strict=True) if m["role"] == "user"]
    answer = classify(users[-1] if users else texts[-1])
    tokens = sum(map(_tokens, texts)), _tokens(answer)
    return Outcome(
        custom_id,
        200,
        {
            "id": "chatcmpl-" + _hex(custom_id),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer, "refusal": None},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": tokens[0],
                "completion_tokens": tokens[1],
                "total_tokens": sum(tokens),
            },
        },
        tokens=tokens,
    )


def _embeddings(custom_id: str, body: Any) -> Outcome:
    model, given = body["model"], body["input"]
    texts = [given] if isinstance(given, str) else given
    dimensions = body.get("dimensions", 8)
    if not (isinstance(model, str) and isinstance(dimensions, int) and 0 < dimensions <= 64):
        raise TypeError
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise TypeError
    data = [
        {"object": "embedding", "index": i, "embedding": _vector(t, dimensions)}
        for i, t in enumerate(texts)
    ]
    tokens = sum(map(_tokens, texts))
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    body = {"object": "list", "data": data, "model": model, "usage": usage}
    return Outcome(custom_id, 200, body, tokens=(tokens, 0))


def _vector(text: str, dimensions: int) -> list[float]:
    """A unit vector fixed by the text."""
    digest = hashlib.blake2b(text.encode(), digest_size=dimensions).digest()
    raw = [b - 127.5 for b in digest]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def _message(custom_id: str, params: Any) -> Outcome:
    model, messages, max_tokens = params["model"], params["messages"], params["max_tokens"]
    if not (isinstance(model, str) and isinstance(max_tokens, int) and max_tokens > 0):
        raise TypeError
    if not messages or any(m["role"] not in ("user", "assistant") for m in messages):
        raise ValueError
    texts = [_text(m["content"]) for m in messages]
    users = [t for m, t in zip(messages, texts, strict=True) if m["role"] == "user"]
    if params.get("system") is not None:
        texts.insert(0, _text(params["system"]))
    answer = classify(users[-1] if users else texts[-1])
    tokens = sum(map(_tokens, texts)), _tokens(answer)
    return Outcome(
        custom_id,
        200,
        {
            "id": "msg_" + _hex(custom_id),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": answer}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": tokens[0],
                "output_tokens": tokens[1],
                "service_tier": "batch",
            },
        },
        tokens=tokens,
    )


def _hex(custom_id: str) -> str:
    return hashlib.blake2b(custom_id.encode(), digest_size=12).hexdigest()


_ANSWERS: Final[dict[str, Callable[[str, Any], Outcome]]] = {
    CHAT: _chat,
    EMBEDDINGS: _embeddings,
    MESSAGES: _message,
}
_BAD: Final = {
    CHAT: "expected a body with 'model' and a non-empty list of 'messages', each with a 'role' "
    "and a 'content' that is a string or a list of text parts",
    EMBEDDINGS: "expected a body with 'model', an 'input' that is a non-empty string or list of "
    "them, and optional 'dimensions' from 1 to 64",
    MESSAGES: "expected params with 'model', a positive integer 'max_tokens' and a non-empty "
    "list of 'messages', each with a 'role' (user or assistant) and a string or text-block "
    "'content'",
}


def jsonl(lines: Sequence[dict[str, Any]]) -> bytes:
    """Lines of JSON, as both providers write their result files."""
    return b"".join(json.dumps(line, separators=(",", ":")).encode() + b"\n" for line in lines)
