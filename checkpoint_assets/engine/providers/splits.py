"""A shard's rows cut into submissions within the provider's limits, and what each may cost.

The input rows are read a slice at a time as the submissions take them (``rows_of``), each
turned into its request body by the job's ``request``. A submission closes when the next request
would pass the provider's ``max_requests`` or ``max_bytes`` (``splits``), or the room left in the
provider's queue (``Room``: requests, estimated input tokens, batches).

A request's input tokens, as a queue counts them, are estimated from the text its body bills
(``calls/tokens.py``'s ``text_of``): its bytes over 4, rounded up.

Spend budget. Before a submission is recorded or sent, its cost is estimated and reserved in the
run's spend (``Spend.reserve``, at the batch price):

- input tokens: the bytes the provider counts for each request, divided by 4 (``size()``: its
  JSONL line, or its entry in the create's body);
- output tokens: each body's ``max_tokens``, ``max_completion_tokens`` or
  ``max_output_tokens``, the adapter's defaults filled in (0 when it names none, as an
  embedding request);
- priced by the body's ``model`` when the budget has a ``model_column``.

When it does not fit, nothing more is submitted. The submissions made are collected (a waiting
run) or left for the next run, and the run ends with :class:`BudgetExceededError`. When a
submission's results are stored, its reservation is replaced by what its rows cost at the batch
price.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from checkpoint_assets.engine.calls.budget import Budget
from checkpoint_assets.engine.calls.tokens import text_of
from checkpoint_assets.engine.plan.inputs import Prepared
from checkpoint_assets.engine.providers.submission_records import new_tag
from checkpoint_assets.engine.providers.submissions import BatchProvider, Request, custom_id
from checkpoint_assets.engine.rows import BOOKKEEPING, INPUT_HASH

_ROWS_PER_CHUNK = 4096  # input rows turned into dicts at a time
_BYTES_PER_TOKEN = 4  # a request's input tokens, estimated from its bytes (see the docstring)
_MAX_OUTPUT = ("max_tokens", "max_completion_tokens", "max_output_tokens")  # a body's cap


@dataclass
class Split:
    """The rows of one submission, before it is sent: their requests, the bytes of each (as the
    provider counts them), ids and input hashes."""

    tag: str
    requests: list[Request] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    tokens: int = 0  # estimated input tokens of its requests, as a queue counts them

    def add(self, request: Request, size: int, row_id: Any, input_hash: int, tokens: int) -> None:
        self.requests.append(request)
        self.sizes.append(size)
        self.ids.append(row_id)
        self.hashes.append(input_hash)
        self.tokens += tokens

    def estimate(self, budget: Budget, defaults: Mapping[str, Any]) -> float:
        """USD the submission may cost at the batch price (see the module docstring)."""
        tokens: dict[str | None, list[float]] = {}  # model -> [input, output]
        for request, size in zip(self.requests, self.sizes, strict=True):
            body = {**defaults, **request.body}
            model = body.get("model") if budget.model_column else None
            counted = tokens.setdefault(None if model is None else str(model), [0.0, 0.0])
            counted[0] += size / _BYTES_PER_TOKEN
            counted[1] += next((body[k] for k in _MAX_OUTPUT if _is_count(body.get(k))), 0)
        return sum(budget.cost(m, i, o, batch=True) for m, (i, o) in tokens.items())


@dataclass
class Room:
    """What the submissions still to make may take of the provider's queue (None: no bound).

    ``splits`` takes what each submission holds off it as it makes them."""

    requests: int | None = None
    tokens: int | None = None
    batches: int | None = None


def request_tokens(body: Any) -> int:
    """A request's input tokens, estimated as a queue counts them (see the module docstring)."""
    return -(-len(text_of(body).encode()) // _BYTES_PER_TOKEN)


def splits(
    provider: BatchProvider,
    rows: Iterable[tuple[dict[str, Any], int]],
    body: Callable[[dict[str, Any]], dict[str, Any]],
    id_column: str,
    room: Room | None = None,
) -> Iterator[Split]:
    """``rows`` (input dicts with their input hashes) as submissions within ``provider``'s
    limits and the ``room`` left in its queue; ``body(row)`` is a row's request body. It stops
    at the first row that no room is left for: the rows after it wait for another call."""
    limits, room = provider.limits, room or Room()
    split, size = Split(new_tag()), 0

    def fits(split: Split, size: int, tokens: int) -> bool:
        if len(split.requests) >= limits.max_requests or size > limits.max_bytes:
            return False
        if room.requests is not None and len(split.requests) >= room.requests:
            return False
        return room.tokens is None or split.tokens + tokens <= room.tokens

    def close(split: Split) -> Split:
        for name, taken in (("requests", len(split.requests)), ("tokens", split.tokens)):
            if getattr(room, name) is not None:
                setattr(room, name, getattr(room, name) - taken)
        if room.batches is not None:
            room.batches -= 1
        return split

    for row, input_hash in rows:
        if room.batches is not None and room.batches <= 0:
            return
        request = Request(custom_id(split.tag, len(split.requests)), body(row))
        request_size, tokens = provider.size(request), request_tokens(request.body)
        if not fits(split, size + request_size, tokens):
            if not split.requests:
                return  # no room for this row at all
            yield close(split)
            if room.batches is not None and room.batches <= 0:
                return
            split, size = Split(new_tag()), 0
            request = Request(custom_id(split.tag, 0), request.body)
            request_size = provider.size(request)
            if not fits(split, request_size, tokens):
                return
        split.add(request, request_size, row[id_column], input_hash, tokens)
        size += request_size
    if split.requests:
        yield close(split)


def rows_of(prepared: Prepared, keys: pl.DataFrame) -> Iterator[tuple[dict[str, Any], int]]:
    """The input rows of ``keys`` (rows of the shard's keys, in order) as dicts, with their
    input hashes, read a slice at a time as the splits take them."""
    for frame in prepared.todo(keys, _ROWS_PER_CHUNK):
        visible = frame.select([c for c in frame.columns if c not in BOOKKEEPING])
        for start in range(0, frame.height, _ROWS_PER_CHUNK):
            dicts = visible.slice(start, _ROWS_PER_CHUNK).to_dicts()
            hashes = frame.get_column(INPUT_HASH).slice(start, _ROWS_PER_CHUNK).to_list()
            yield from zip(dicts, hashes, strict=True)


def _is_count(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
