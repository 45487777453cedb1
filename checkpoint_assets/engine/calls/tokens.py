"""Counting the tokens of a request before it is sent: a tokenizer where one is installed.

- :func:`counter` returns ``tiktoken``'s encoding of the model when ``tiktoken`` is importable
  and its encoding loads. A model it does not know gets ``o200k_base``. Otherwise it counts
  bytes over 4, the rule of thumb for English text.
- :func:`text_of` is the text a provider bills as input in a request body. That is every string
  in it except the model's name and the roles, without JSON punctuation and keys.

>>> count = Counter.bytes()
>>> count.name, count.tokens(pl.Series(["abc abc abc abc ", "abc"])).to_list()
('bytes/4', [4, 1])
>>> text_of({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
'hi'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

BYTES_PER_TOKEN = 4
MAX_OUTPUT = ("max_tokens", "max_completion_tokens", "max_output_tokens")  # a body's output cap
_NOT_BILLED = frozenset({"model", "role"})  # strings of a request body that are not its text
DEFAULT_ENCODING = "o200k_base"


@dataclass(frozen=True)
class Counter:
    """Counts the tokens of texts: ``name`` says how (``tiktoken o200k_base``, ``bytes/4``)."""

    name: str
    count: Callable[[pl.Series], pl.Series]

    def tokens(self, texts: pl.Series) -> pl.Series:
        """The tokens of each text (a null text has none)."""
        return self.count(texts.fill_null("")).cast(pl.Int64)

    @classmethod
    def bytes(cls) -> Counter:
        """Bytes over 4, rounded up, for each text."""
        return cls(
            f"bytes/{BYTES_PER_TOKEN}",
            lambda texts: (texts.str.len_bytes() / BYTES_PER_TOKEN).ceil(),
        )


def counter(model: str | None) -> Counter:
    """``tiktoken``'s encoding of ``model`` when it is installed and loads, else bytes/4."""
    try:
        import tiktoken
    except ImportError:
        return Counter.bytes()
    try:
        try:
            encoding = tiktoken.encoding_for_model(model or "")
        except KeyError:  # a model tiktoken does not know: its newest encoding
            encoding = tiktoken.get_encoding(DEFAULT_ENCODING)
    except Exception:  # its encoding file cannot be fetched (offline): the rule of thumb
        return Counter.bytes()
    return Counter(
        f"tiktoken {encoding.name}",
        lambda texts: pl.Series([len(e) for e in encoding.encode_ordinary_batch(texts.to_list())]),
    )


def text_of(body: Any) -> str:
    """The text of a request body a provider bills as input: its strings, one per line, but
    the model's name and the messages' roles."""
    found: list[str] = []
    _strings(body, found)
    return "\n".join(found)


def _strings(value: Any, found: list[str]) -> None:
    if isinstance(value, str):
        found.append(value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if key not in _NOT_BILLED:
                _strings(item, found)
    elif isinstance(value, list | tuple):
        for item in value:
            _strings(item, found)


def max_output(body: Mapping[str, Any]) -> int | None:
    """The most output tokens a request body allows (``max_tokens`` and its other names), or
    None when it names none."""
    for key in MAX_OUTPUT:
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return int(value)
    return None
