"""What a shard sends through a provider's batch API (``ProviderJob``), and how (``Mode``).

Modes (``ProviderJob.mode``):

- ``batch`` runs the steps of ``provider_batches.py``.
- ``hybrid`` submits the same way, but sends no row again as a batch. The rows of an expired,
  cancelled or failed batch, and the requests that failed in a transient way, are finished
  online (``online.py``) while the other batches wait. At ``deadline_seconds`` after the run's
  start it cancels every open submission. Each is collected once it has ended, and its rows
  without a result go online.
- ``online`` submits nothing. It cancels the open submissions of earlier runs (collected
  likewise), and every other row goes online.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from checkpoint_assets.engine.providers import online
from checkpoint_assets.engine.providers.submissions import BatchProvider


class Mode(enum.StrEnum):
    """How a request/parse job runs (see the module docstring)."""

    online = "online"
    batch = "batch"
    hybrid = "hybrid"


@dataclass(frozen=True)
class ProviderJob:
    """What a shard sends through a provider's batch API, and how it waits.

    ``request(row)`` gets the id and input columns of one row as a dict and returns its request
    body; ``parse(body)`` gets the provider's response body of that row and returns a dict of
    output columns (the same keys for every row). ``wait`` False ends the run once its rows are
    submitted (step 5 of ``provider_batches.py``). ``keep_answers`` stores each response body in
    ``_answer``; ``recompute_unanswered`` sends the finished rows without one again when
    ``parse`` changed. ``mode``, ``deadline_seconds``: see the module docstring; ``send(body)``
    sends one body online and returns the response body (the endpoint resource's ``sender``),
    needed by ``online`` and ``hybrid``.
    """

    provider: BatchProvider
    request: Callable[[dict[str, Any]], dict[str, Any]]
    parse: Callable[[dict[str, Any]], Mapping[str, Any]]
    wait: bool = True
    poll_seconds: float = 10.0
    max_poll_seconds: float = 300.0
    mode: Mode = Mode.batch
    deadline_seconds: float | None = None
    send: online.Send | None = None
    keep_answers: bool = True
    recompute_unanswered: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.mode is not Mode.batch and self.send is None:
            raise ValueError(f"mode {self.mode.value} sends rows online: it needs send")
        if self.mode is Mode.hybrid and not self.wait:
            raise ValueError(
                "mode hybrid finishes rows online in the run, so it waits for its batches: "
                "drop wait: false, or use mode batch to submit and end."
            )
        if self.deadline_seconds is not None and self.deadline_seconds < 0:
            raise ValueError(f"deadline must be at least 0 seconds, got {self.deadline_seconds}")
