"""How one run behaves, and what it did: ``Settings`` (the one source of defaults) and ``RunStats``.

The decorator's defaults, the run config's "use the asset's" and the engine's behaviour all read
the defaults declared here.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_LEASE_SECONDS = 300.0


class OnInputChange(enum.StrEnum):
    """What to do with finished rows whose input changed since their result was stored."""

    fail = "fail"
    recompute = "recompute"


@dataclass(frozen=True)
class Settings:
    """How one run behaves.

    ``checkpoint_interval`` rows make a flush; ``batch_size`` rows make a call (None: one
    interval). ``min_flush_seconds=None`` takes the store's own minimum (0 on local disk, a few
    seconds on object stores, where each flush costs requests).
    """

    id_column: str
    input_columns: tuple[str, ...] = ()
    checkpoint_interval: int = 16
    batch_size: int | None = None
    flush_seconds: float = 30.0
    min_flush_seconds: float | None = None
    resume: bool = True
    checkpointing: bool = True
    retry_failed: bool = True
    on_input_change: OnInputChange = OnInputChange.fail
    dedupe: bool = False
    max_failed_fraction: float = 0.0
    max_concurrency: int = 1
    min_concurrency: int = 1
    adaptive_concurrency: bool = True
    max_attempts: int = 3
    retry_delay_seconds: float = 1.0
    max_throttle_seconds: float = 600.0
    usage_columns: tuple[str, ...] = ()
    progress_seconds: float = 10.0
    lease_seconds: float = DEFAULT_LEASE_SECONDS

    def __post_init__(self) -> None:
        # Accept the plain strings "fail" / "recompute" as well as the enum.
        object.__setattr__(self, "on_input_change", OnInputChange(self.on_input_change))
        if self.checkpoint_interval < 1:
            raise ValueError(
                f"checkpoint_interval must be at least 1, got {self.checkpoint_interval}"
            )
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.max_throttle_seconds <= 0:
            raise ValueError(
                f"max_throttle_seconds must be positive, got {self.max_throttle_seconds}"
            )
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if not 1 <= self.min_concurrency <= self.max_concurrency:
            raise ValueError(
                f"min_concurrency must be between 1 and max_concurrency "
                f"({self.max_concurrency}), got {self.min_concurrency}"
            )

    @property
    def batch_rows(self) -> int:
        """Rows per call."""
        return self.batch_size or self.checkpoint_interval

    @property
    def max_unflushed_rows(self) -> int:
        """Rows that may wait for storage before dispatching waits for it too: while a flush is
        being written, rows done meanwhile join the next one (group commit) up to this bound."""
        return 2 * self.checkpoint_interval + self.max_concurrency * self.batch_rows

    @property
    def batches_held(self) -> int:
        """Batches a shard holds at once: in flight, or done and not yet handed to the sink.

        ``max_concurrency`` calls, plus a quarter more done batches, so a worker whose call has
        returned takes its next batch without waiting for the run loop to take its result (that
        round trip between threads costs one-row calls about 5 % of their throughput).
        """
        return self.max_concurrency + -(-self.max_concurrency // 4)


@dataclass
class RunStats:
    """What a run did; becomes the materialization's metadata."""

    rows_total: int = 0
    rows_computed: int = 0
    rows_resumed: int = 0
    rows_failed: int = 0
    rows_reused: int = 0
    rows_dropped: int = 0
    rows_changed: int = 0
    rows_imported: int = 0
    calls: int = 0
    failed_calls: int = 0
    throttled_calls: int = 0
    throttle_events: int = 0
    throttled_seconds: float = 0.0
    concurrency_final: int = 0
    flushes: int = 0
    seconds: float = 0.0
    # How long storage held the run up: waiting for the flush in flight, and finalize. The
    # background writer's own time overlaps the calls and is not counted.
    wait_seconds: float = 0.0
    finalize_seconds: float = 0.0
    input_fingerprint: str = ""
    checkpoint_path: str = ""
    requests: dict[str, int] = field(default_factory=dict)
    # Sums of the ``usage_columns``: over the rows this run computed, and over every stored row.
    usage: dict[str, float] = field(default_factory=dict)
    usage_total: dict[str, float] = field(default_factory=dict)
    # What differs from the function that computed the stored results it reused (same job).
    function_changed: list[str] = field(default_factory=list)

    @property
    def rows_per_second(self) -> float:
        return round(self.rows_computed / self.seconds, 2) if self.seconds > 0 else 0.0

    @property
    def storage_wait_seconds(self) -> float:
        """How long checkpointing held the run up: waits for flushes, then finalize."""
        return round(self.wait_seconds + self.finalize_seconds, 3)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rows_per_second"] = self.rows_per_second
        out["storage_wait_seconds"] = self.storage_wait_seconds
        return out
