"""``POST /v1/chat/completions``: the chat server's OpenAI route."""

from __future__ import annotations

import json
import time
from typing import Any, Final

from starlette.responses import JSONResponse, Response

from examples.llm_openai.answers import Asked
from examples.llm_openai.budget import KeyBudget


class OpenAIChat:
    """``POST /v1/chat/completions`` of the OpenAI API."""

    bad_request = (
        "expected a JSON body with 'model' and a non-empty list of 'messages', "
        "each with a string 'content'"
    )
    _KINDS: Final = {
        400: ("invalid_request_error", None),
        429: ("requests", "rate_limit_exceeded"),
        500: ("server_error", None),
        529: ("server_error", "overloaded"),
    }

    def read(self, body: Any) -> Asked:
        model = body["model"]
        messages = body["messages"]
        texts = [m["content"] for m in messages]
        if not (isinstance(model, str) and texts and all(isinstance(t, str) for t in texts)):
            raise TypeError
        user = [m["content"] for m in messages if m.get("role") == "user"]
        conversation = json.dumps(messages, sort_keys=True).encode()
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or 0
        return Asked(model, texts, user[-1] if user else texts[-1], conversation, int(limit))

    def limit_headers(self, budget: KeyBudget, wall: float) -> dict[str, str]:
        return budget.openai_headers()

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        kind, code = self._KINDS[status]
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
        return JSONResponse(body, status_code=status, headers=headers)

    def quota_spent(self) -> Response:
        message = "You exceeded your current quota, please check your plan and billing details."
        error = {"message": message, "type": "insufficient_quota", "param": None}
        return JSONResponse({"error": {**error, "code": "insufficient_quota"}}, status_code=429)

    def answer(self, asked: Asked, answer: str, tokens: tuple[int, int], number: int) -> Response:
        prompt_tokens, completion_tokens = tokens
        return JSONResponse(
            {
                "id": f"chatcmpl-{number}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": asked.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": answer},
                        "finish_reason": "stop",
                        "logprobs": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )
