"""How one run behaves, and what it did: ``Settings`` (the one source of defaults) and ``RunStats``.

The decorator's defaults, the run config's "use the asset's" and the engine's behaviour all read
the defaults declared here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from checkpoint_assets.engine.calls.budget import Budget
from checkpoint_assets.engine.checkpoints.compaction import COMPACT_AT, COMPACT_FANOUT
from checkpoint_assets.engine.fields import setting
from checkpoint_assets.engine.storage.local import LocalStore
from checkpoint_assets.engine.storage.objects import ObjectStore

DEFAULT_LEASE_SECONDS = 300.0


class OnInputChange(enum.StrEnum):
    """What to do with finished rows whose input changed since their result was stored."""

    fail = "fail"
    recompute = "recompute"


@dataclass(frozen=True, kw_only=True)
class RowSettings:
    """What an asset declares about its rows, whatever computes them (a function, or a
    provider's batch API): the one declaration of each of these settings.

    ``checkpointed_asset`` and ``provider_batch_asset`` take these fields as keyword arguments,
    ``CheckpointedAssetComponent`` as attributes. All are derived from the fields (type, default,
    ``DOC``), and the docs' reference shows them. Values out of range are refused by name, never
    replaced.
    """

    retry_failed: bool = setting(True, "Compute rows stored as failed again on the next run.")
    on_input_change: OnInputChange | Literal["fail", "recompute"] = setting(
        "fail", "fail, or recompute finished rows whose input changed."
    )
    dedupe: bool = setting(False, "Call the function once per distinct input; copies share it.")
    max_failed_fraction: float = setting(
        0.0, "Above this fraction of failed rows the run fails (after checkpointing the rest)."
    )
    max_attempts: int = setting(
        3,
        "Attempts per row: calls of a failing batch before it is split to isolate poison rows. "
        "Through a provider's batch API: requests of a row that failed in a transient way.",
    )
    usage_columns: Sequence[str] = setting(
        (),
        "Numeric output columns (tokens, cost) summed into the metadata as usage/<col> (this "
        "run) and usage_total/<col> (every stored row).",
    )
    stop_at_failed_shard: bool = setting(
        False,
        "In a run of several shards (a ranged backfill run), stop at the first shard that "
        "fails. By default the other shards still run, and the run fails at its end naming "
        "the failed ones.",
    )
    budget: Budget | None = setting(
        None,
        "A Budget: prices per model, read against two of the usage_columns, so each "
        "materialization records its cost. Its spend limits, max_run_cost and max_asset_cost "
        "(every shard and run), stop new calls with BudgetExceededError when reached.",
    )

    def __post_init__(self) -> None:
        # Accept the plain strings "fail" / "recompute" as well as the enum, and any sequence of
        # usage columns (kept as a tuple: settings are frozen).
        object.__setattr__(self, "on_input_change", OnInputChange(self.on_input_change))
        object.__setattr__(self, "usage_columns", tuple(self.usage_columns))
        # Refused by name rather than replaced: 0 attempts would call nothing, a negative
        # fraction means nothing.
        _at_least(self, 1, "max_attempts")
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            raise ValueError(
                f"max_failed_fraction must be between 0 and 1, got {self.max_failed_fraction}"
            )
        unpriced = (
            [c for c in self.budget.columns if c not in self.usage_columns] if self.budget else []
        )
        if unpriced:
            raise ValueError(
                f"the budget prices the token columns {unpriced}, which are not among "
                f"usage_columns {list(self.usage_columns)}: add them to usage_columns (or name "
                "the budget's input_tokens / output_tokens after the usage columns you have)"
            )

    def settings(self) -> dict[str, Any]:
        """The values of these fields (only these, in a subclass too), by name."""
        return {f.name: getattr(self, f.name) for f in fields(RowSettings)}


@dataclass(frozen=True, kw_only=True)
class AssetSettings(RowSettings):
    """What an asset declares about how its runs behave: its rows' settings, and how the
    function is called and its results flushed (see ``RowSettings``)."""

    checkpoint_interval: int = setting(
        16, "Rows per flush (parts are written every this many rows)."
    )
    batch_size: int | None = setting(
        None,
        "Rows per call (default: checkpoint_interval). One-row calls to a remote model want 1, "
        "with a larger checkpoint_interval.",
    )
    flush_seconds: float = setting(30.0, "Flush at least this often while rows are done.")
    min_flush_seconds: float | None = setting(
        None,
        "Never flush more often than this (default 0 locally, 5 on object stores, where each "
        "flush costs requests).",
    )
    max_concurrency: int = setting(
        1, "Batches in flight at once (threads, or asyncio tasks for an async function)."
    )
    min_concurrency: int = setting(
        1, "The fewest batches in flight that rate limits may bring it down to."
    )
    adaptive_concurrency: bool = setting(
        True,
        "Follow what the endpoint sustains between the two (false: keep max_concurrency, for an "
        "endpoint whose limit is known).",
    )
    retry_delay_seconds: float = setting(
        1.0,
        "First delay between attempts, doubled each time (also the first back-off of a rate "
        "limit that does not say how long to wait).",
    )
    max_throttle_seconds: float = setting(
        600.0, "Stop after being rate limited this long without a single successful call."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
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
        _at_least(self, 0, "flush_seconds", "retry_delay_seconds")
        if self.min_flush_seconds is not None:
            _at_least(self, 0, "min_flush_seconds")

    def settings(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(AssetSettings)}


@dataclass(frozen=True)
class Settings(AssetSettings):
    """How one run behaves: the asset's settings, and what the run (its config, the engine)
    adds to them.

    ``checkpoint_interval`` rows make a flush; ``batch_size`` rows make a call (None: one
    interval). ``min_flush_seconds=None`` takes the store's own minimum (0 on local disk, a few
    seconds on object stores, where each flush costs requests).
    """

    id_column: str
    input_columns: tuple[str, ...] = ()
    resume: bool = True
    checkpointing: bool = True
    progress_seconds: float = 10.0
    lease_seconds: float = DEFAULT_LEASE_SECONDS

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self, 0, "progress_seconds")
        if self.lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, got {self.lease_seconds}")

    @property
    def batch_rows(self) -> int:
        """Rows per call."""
        return self.batch_size or self.checkpoint_interval

    @property
    def max_unflushed_rows(self) -> int:
        """Rows that may wait for storage before dispatching waits for it too.

        While a flush is being written, rows done meanwhile join the next one (group commit), up
        to this bound.
        """
        return 2 * self.checkpoint_interval + self.max_concurrency * self.batch_rows

    @property
    def batches_held(self) -> int:
        """Batches a shard holds at once: in flight, or done and not yet handed to the sink.

        That is ``max_concurrency`` calls, plus a quarter more done batches. A worker whose call
        has returned then takes its next batch without waiting for the run loop to take its
        result. Waiting for that round trip between threads would cost one-row calls about 5 %
        of their throughput.
        """
        return self.max_concurrency + -(-self.max_concurrency // 4)

    def loss_bound(
        self, rows_per_second: float = 0.0, store_min_flush_seconds: float = 0.0
    ) -> LossBound:
        """The most a hard kill (SIGKILL, a lost node) can lose.

        That is the rows computed whose results are not durable yet. A later run computes them
        again (see ``engine/loop/sink.py``).

        ``rows_per_second`` matters only with a minimum time between flushes. That is
        ``min_flush_seconds``, or ``store_min_flush_seconds`` when it is None (5 s on object
        stores). The buffer then holds the rows of that time.

        >>> Settings("id", checkpoint_interval=64, batch_size=1, max_concurrency=32).loss_bound()
        LossBound(buffered=160, writing=160, held=40, batch_rows=1)
        """
        floor = self.min_flush_seconds
        floor = store_min_flush_seconds if floor is None else floor
        rows_in_floor = math.ceil(rows_per_second * floor)
        # The last batch added may cross the bound by all its rows but one.
        buffered = max(self.max_unflushed_rows, rows_in_floor) + self.batch_rows - 1
        held = self.batches_held * self.batch_rows
        return LossBound(buffered, buffered, held, self.batch_rows)

    def request_budget(self, flushes: int, seconds: float) -> int:
        """The most storage requests (on S3) a run into a new checkpoint makes, given the
        flushes it made and how long it held the lock (see ``engine/storage/base.py``):

        - 13 to start and finish:
            - the lock: a conditional PUT, then a GET and a DELETE to release it;
            - the meta: a GET and a PUT at the start, a PUT when the outputs are known, a PUT at
              the end;
            - the merged file: a GET at the start and at finalize, and a PUT;
            - the parts' listing, at the start and at finalize;
            - one DELETE of the merged parts;
        - one PUT per flush (the last rows go into the merged file instead);
        - a PUT and a DELETE per compaction: eight parts become one once 56 exist, so at most
          one per seven parts beyond 55;
        - a GET and a PUT per lock renewal, every third of ``lease_seconds``.

        >>> Settings("id").request_budget(flushes=7, seconds=36.0)
        20
        """
        compactions = max(0, -(-(flushes - COMPACT_AT + 1) // (COMPACT_FANOUT - 1)))
        renewals = int(seconds // max(self.lease_seconds / 3, 0.05))
        return 13 + flushes + 2 * compactions + 2 * renewals


@dataclass(frozen=True)
class LossBound:
    """What a hard kill can lose, term by term (``loss_bound``), in rows:

    - ``buffered``: the rows done since the last flush. While storage keeps up, that is about
      one ``checkpoint_interval``, or the rows done in the minimum time between flushes. When
      storage lags, rows join the next flush (group commit) up to ``max_unflushed_rows``. The
      last batch may cross that bound by all its rows but one.
    - ``writing``: the flush being written, at most one, no larger than the buffer was.
    - ``held``: the calls in flight and the results the run loop has not taken yet,
      ``batches_held`` batches.
    """

    buffered: int
    writing: int
    held: int
    batch_rows: int

    @property
    def rows(self) -> int:
        """Rows a kill can make later runs compute again."""
        return self.buffered + self.writing + self.held

    @property
    def calls(self) -> int:
        """Calls a kill can make later runs pay for again."""
        buffered = 2 * math.ceil(self.buffered / self.batch_rows)
        return buffered + self.held // self.batch_rows


def loss_bound(
    rows_per_second: float = 0.0, *, object_store: bool = False, **arguments: Any
) -> LossBound:
    """The most one shard's run can lose to a hard kill (SIGKILL, a lost node, an out-of-memory
    kill): the rows it computed whose results were not stored yet, which a later run computes
    again. An exception, SIGTERM or SIGINT loses nothing.

    ``arguments`` are the asset's own, as given to ``checkpointed_asset``:
    ``checkpoint_interval``, ``batch_size``, ``max_concurrency``, ``min_flush_seconds`` (the
    others change nothing here). ``object_store`` is True when the IO manager's ``base_dir`` is
    an object store (``s3://``, ``gs://``, ``az://``), where flushes come at most every few
    seconds unless ``min_flush_seconds`` says otherwise; ``rows_per_second`` is how fast the
    function goes, which then sets how many rows wait for the next flush.

    Example::

        >>> bound = loss_bound(checkpoint_interval=64, batch_size=1, max_concurrency=32)
        >>> bound
        LossBound(buffered=160, writing=160, held=40, batch_rows=1)
        >>> bound.rows, bound.calls
        (360, 360)
        >>> loss_bound(100, object_store=True).rows
        1062
    """
    known = {f.name for f in fields(AssetSettings)}
    unknown = sorted(set(arguments) - known)
    if unknown:
        raise TypeError(
            f"loss_bound() takes the asset's arguments, and {unknown} is not one of them: "
            f"give some of {sorted(known)}"
        )
    store = ObjectStore if object_store else LocalStore
    settings = Settings(id_column="id", **arguments)
    return settings.loss_bound(rows_per_second, store.min_flush_seconds)


def _at_least(settings: RowSettings, least: int, *names: str) -> None:
    for name in names:
        value = getattr(settings, name)
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")


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
    rows_from_store: int = 0
    calls: int = 0
    # A request/parse job (engine/providers/): how it ran (online, batch, hybrid), rows asked
    # online in this run, and batch results dropped because their row was stored already.
    mode: str | None = None
    rows_online: int = 0
    batch_results_dropped: int = 0
    # Provider batches and the provider's queue (engine/providers/queue.py): submissions it
    # refused for want of room, seconds the run waited for room, the highest share of the queue's
    # limit its claims took when the run looked (None: no limit known), rows left waiting for room.
    submissions_refused: int = 0
    queue_wait_seconds: float = 0.0
    queue_use: float | None = None
    rows_waiting_for_queue: int = 0
    failed_calls: int = 0
    throttled_calls: int = 0
    throttle_events: int = 0
    throttled_seconds: float = 0.0
    concurrency_final: int = 0
    # Pacing by the key's budgets (engine/calls/pacing.py): the share of the budget this run drew
    # while it called (None: no budget stated or assumed), and how long requests waited for it.
    budget_used: float | None = None
    budget_wait_seconds: float = 0.0
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
    # What this run's calls cost (USD, with a budget's prices; see engine/calls/budget.py).
    cost_usd: float | None = None
    cost_by_model: dict[str, float] = field(default_factory=dict)
    # What the rows taken from the result store cost when computed (USD, with a budget).
    cost_saved_usd: float | None = None
    # What differs from the function that computed the stored results it reused (same job).
    function_changed: list[str] = field(default_factory=list)
    # A request/parse job whose parse changed: stored answers parsed again (no request), and
    # finished rows without a stored answer.
    rows_reparsed: int = 0
    rows_without_answer: int = 0

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
