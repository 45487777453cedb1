"""What the chat server answers, whichever API asks: ``classify`` (the demo's keyword rules),
the request as every route reads it (``Asked``) and the contract of a route (``Api``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final, Protocol

from starlette.responses import Response

from examples.llm_openai.budget import KeyBudget
from examples.ticket_routing.model import DEPARTMENT_RULES

DEFAULT_MODEL: Final = "ticket-router-1"
_RULES: Final = [
    (name, re.compile(strong, re.ASCII), re.compile(weak, re.ASCII))
    for name, (strong, weak) in DEPARTMENT_RULES.items()
]


def classify(text: str) -> str:
    """The department the demo's keyword rules pick for ``text``.

    Two points per strong keyword, one per weak one; the highest score wins, ties go to the
    department listed first, and text with no keyword goes to ``other``: the same rules as the
    demo's ``FakeRouter``.

    >>> classify("I was charged twice, please refund me")
    'billing'
    """
    lowered = text.lower()
    best, top = "other", 0
    for name, strong, weak in _RULES:
        score = 2 * len(strong.findall(lowered)) + len(weak.findall(lowered))
        if score > top:
            best, top = name, score
    return best


def count_tokens(text: str) -> int:
    return len(text.split())


@dataclass(frozen=True)
class Asked:
    """A request, read the same way whichever API it came through."""

    model: str
    texts: list[str]  # every message's text, the system prompt included
    question: str  # the text classified: the last user message
    conversation: bytes  # what decides the request's fate (see ``ChatServer._draw``)
    max_tokens: int = 0  # the most answer tokens it asked for (0: unset)


class Api(Protocol):
    """How one API reads a request and writes its answers and errors."""

    bad_request: str

    def read(self, body: Any) -> Asked:
        """The request, or ValueError / KeyError / TypeError when it is malformed."""

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        """An error response in the API's shape, which its client turns into an exception."""

    def quota_spent(self) -> Response:
        """The API's answer once the account's quota is spent (no retry helps)."""

    def answer(self, asked: Asked, answer: str, tokens: tuple[int, int], number: int) -> Response:
        """The answer, with ``tokens`` = (prompt, completion) as the API's usage."""

    def limit_headers(self, budget: KeyBudget, wall: float) -> dict[str, str]:
        """The rate-limit headers of the key's budgets, as the API sends them (``wall``: the
        POSIX time now)."""
