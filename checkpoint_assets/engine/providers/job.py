"""What a shard sends through a provider's batch API (``ProviderJob``), and how (``Way``).

Modes (``Way.mode``):

- ``batch`` runs the steps of ``provider_batches.py``.
- ``hybrid`` submits the same way, but sends no row again as a batch. The rows of an expired,
  cancelled or failed batch, and the requests that failed in a transient way, are finished
  online (``online.py``) while the other batches wait. At ``deadline_seconds`` after the run's
  start it cancels every open submission. Each is collected once it has ended, and its rows
  without a result go online.
- ``online`` submits nothing. It cancels the open submissions of earlier runs (collected
  likewise), and every other row goes online.

:class:`Way` holds a job's mode, deadline and waiting, with their defaults, meanings and rules:
``Way.of`` reads them as a user writes them (the decorator's arguments, run config over them).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from checkpoint_assets.engine.fields import setting
from checkpoint_assets.engine.providers import online
from checkpoint_assets.engine.providers.submissions import BatchProvider

_DURATION = re.compile(r"(\d+(?:\.\d*)?)(h|m|s)")


class Mode(enum.StrEnum):
    """How a request/parse job runs (see the module docstring)."""

    online = "online"
    batch = "batch"
    hybrid = "hybrid"


MODES = ", ".join(m.value for m in Mode)


@dataclass(frozen=True)
class Way:
    """How a job's rows are asked: its mode, a hybrid run's deadline and whether the run waits.

    :meth:`of` reads one from what a user writes. Every ``Way`` is checked as it is made: a
    deadline of at least 0 seconds, and ``hybrid`` waits.
    """

    mode: Mode = setting(
        Mode.batch,
        f"How rows are asked ({MODES}). online: each row's request sent at once through the "
        "provider's resource; batch: provider batches; hybrid: batches, then online for what "
        "the deadline, an expiry or a failure left.",
    )
    deadline_seconds: float | None = setting(
        None,
        "hybrid: seconds, or a duration such as 90s, 15m or 1h30m, from the run's start, after "
        "which queued batches are cancelled and their rows finished online. Without a deadline, "
        "only rows of expired or failed batches go online.",
    )
    wait: bool = setting(
        True,
        "Wait for the provider's batches and collect them in the run (true), or submit and end, "
        "leaving the partition to provider_batches_sensor (false).",
    )

    def __post_init__(self) -> None:
        if self.deadline_seconds is not None and self.deadline_seconds < 0:
            raise ValueError(f"deadline must be at least 0 seconds, got {self.deadline_seconds}.")
        if self.mode is Mode.hybrid and not self.wait:
            raise ValueError(
                "mode hybrid finishes rows online in the run, so it waits for its batches: "
                "drop wait: false, or use mode batch to submit and end."
            )

    @classmethod
    def of(
        cls,
        mode: str | None = None,
        deadline: float | str | None = None,
        wait: bool | None = None,
        *,
        over: Way | None = None,
    ) -> Way:
        """The way a user wrote: ``mode`` by name, ``deadline`` in seconds or as a duration
        (:func:`seconds_of`). None takes ``over``'s value (the asset's way, which run config
        overrides), else the default. A deadline written over ``over`` needs mode hybrid; the
        asset's own may stand for the runs that run config makes hybrid.
        """
        base = cls() if over is None else over
        way = cls(
            base.mode if mode is None else _mode_of(mode),
            base.deadline_seconds if deadline is None else seconds_of(deadline),
            base.wait if wait is None else wait,
        )
        if over is not None and deadline is not None and way.mode is not Mode.hybrid:
            raise ValueError(
                f"Run config sets a deadline, which only mode hybrid follows, but this run's "
                f"mode is {way.mode.value}: add mode: hybrid, or drop the deadline."
            )
        return way


def _mode_of(value: Any) -> Mode:
    """``value`` as a ``Mode``, or a ValueError that lists the modes."""
    try:
        return Mode(value)
    except ValueError:
        raise ValueError(
            f"mode must be one of {MODES}, got {value!r}: online sends each row's request at "
            "once, batch submits provider batches, hybrid submits batches and finishes online "
            "after the deadline."
        ) from None


def seconds_of(deadline: float | str) -> float:
    """A deadline in seconds: a number of seconds, or a duration such as ``"90s"``, ``"15m"``,
    ``"1h30m"``.

    >>> seconds_of(90), seconds_of("1h30m"), seconds_of("2.5s")
    (90.0, 5400.0, 2.5)
    """
    if isinstance(deadline, int | float) and not isinstance(deadline, bool):
        return float(deadline)
    text = str(deadline).strip()
    parts = _DURATION.findall(text)
    if parts and "".join(n + u for n, u in parts) == text:
        return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"deadline must be seconds or a duration such as 90s, 15m or 1h30m, got {deadline!r}."
        ) from None


@dataclass(frozen=True)
class ProviderJob:
    """What a shard sends through a provider's batch API, and how it waits.

    ``request(row)`` gets the id and input columns of one row as a dict and returns its request
    body; ``parse(body)`` gets the provider's response body of that row and returns a dict of
    output columns (the same keys for every row). ``way``: its mode, deadline and whether it
    waits (:class:`Way`); a run that does not wait ends once its rows are submitted (step 5 of
    ``provider_batches.py``). ``keep_answers`` stores each response body in ``_answer``;
    ``recompute_unanswered`` sends the finished rows without one again when ``parse`` changed.
    ``send(body)`` sends one body online and returns the response body (the endpoint resource's
    ``sender``), needed by ``online`` and ``hybrid``.
    """

    provider: BatchProvider
    request: Callable[[dict[str, Any]], dict[str, Any]]
    parse: Callable[[dict[str, Any]], Mapping[str, Any]]
    way: Way = Way()
    poll_seconds: float = 10.0
    max_poll_seconds: float = 300.0
    send: online.Send | None = None
    keep_answers: bool = True
    recompute_unanswered: bool = False

    def __post_init__(self) -> None:
        mode = self.way.mode
        if mode is not Mode.batch and self.send is None:
            raise ValueError(f"mode {mode.value} sends rows online: it needs send")
