"""``POST /v1/messages``: the chat server's route for Anthropic's Messages API."""

from __future__ import annotations

import json
from typing import Any, Final

from starlette.responses import JSONResponse, Response

from examples.llm_openai.answers import Asked
from examples.llm_openai.budget import KeyBudget


class AnthropicMessages:
    """``POST /v1/messages`` of Anthropic's API, in the shapes the ``anthropic`` client parses.

    ``system`` and each message's ``content`` may be a string or a list of text blocks. Errors
    carry Anthropic's types: ``rate_limit_error`` (429), ``api_error`` (500) and
    ``overloaded_error`` (529), which the client raises as ``RateLimitError``,
    ``InternalServerError`` and ``OverloadedError``.
    """

    bad_request = (
        "expected a JSON body with 'model', a positive integer 'max_tokens' and a non-empty "
        "list of 'messages', each with a 'role' (user or assistant) and a 'content' that is a "
        "string or a list of text blocks"
    )
    _KINDS: Final = {
        400: "invalid_request_error",
        429: "rate_limit_error",
        500: "api_error",
        529: "overloaded_error",
    }

    def read(self, body: Any) -> Asked:
        model, messages, max_tokens = body["model"], body["messages"], body["max_tokens"]
        if not (isinstance(model, str) and isinstance(max_tokens, int) and max_tokens > 0):
            raise TypeError
        if not messages or any(m["role"] not in ("user", "assistant") for m in messages):
            raise ValueError
        texts = [block_text(m["content"]) for m in messages]
        user = [t for m, t in zip(messages, texts, strict=True) if m["role"] == "user"]
        system = body.get("system")
        if system is not None:
            texts.insert(0, block_text(system))
        conversation = json.dumps({"system": system, "messages": messages}, sort_keys=True)
        question = user[-1] if user else texts[-1]
        return Asked(model, texts, question, conversation.encode(), max_tokens)

    def limit_headers(self, budget: KeyBudget, wall: float) -> dict[str, str]:
        return budget.anthropic_headers(wall)

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        body = {"type": "error", "error": {"type": self._KINDS[status], "message": message}}
        return JSONResponse(body, status_code=status, headers=headers)

    def quota_spent(self) -> Response:
        return self.error(
            400,
            "You have reached your specified API usage limits. You will regain access on "
            "2030-01-01 at 00:00 UTC.",
        )

    def answer(self, asked: Asked, answer: str, tokens: tuple[int, int], number: int) -> Response:
        input_tokens, output_tokens = tokens
        return JSONResponse(
            {
                "id": f"msg_{number:024d}",
                "type": "message",
                "role": "assistant",
                "model": asked.model,
                "content": [{"type": "text", "text": answer}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
            }
        )


def block_text(content: Any) -> str:
    """The text of a string or of a list of Anthropic content blocks (text blocks only)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        for b in content
    ):
        return "\n".join(b["text"] for b in content)
    raise TypeError
