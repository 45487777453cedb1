"""A fake, deterministic stand-in for an LLM that routes support tickets.

:class:`FakeRouter` imitates the behaviour that matters when orchestrating a model call over a
large table, without any network or GPU:

* **Latency**: ``latency_ms`` is slept once per call (per batch) and ``per_row_latency_ms`` once
  per row, via :func:`time.sleep`.
* **Transient failures**: with probability ``transient_error_rate`` a whole call raises
  :class:`TransientModelError` (``503 Service Unavailable``).  The decision is a pure function of
  ``(seed, sorted ticket ids of the batch, attempt number)``; the attempt number is counted per
  batch inside the instance, so retrying the same batch eventually succeeds and a re-run with a
  fresh router fails at exactly the same places.
* **Poison rows**: if a batch contains any id in ``poison_ids``, the call raises
  :class:`PoisonRowError` naming the offending id(s), every time, so that a caller can isolate
  the bad rows by splitting the batch.

The "model" itself is a set of vectorised keyword rules (polars ``str.contains``) that map the
subject and body to a ``department``, a ``priority`` and a deterministic ``confidence``.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import polars as pl

from examples.ticket_routing.data import DEPARTMENTS

__all__ = [
    "DEPARTMENTS",
    "DEPARTMENT_RULES",
    "OUTPUT_SCHEMA",
    "PRIORITIES",
    "PRIORITY_RULES",
    "FakeRouter",
    "PoisonRowError",
    "TransientModelError",
]

PRIORITIES: Final[tuple[str, ...]] = ("low", "normal", "high", "urgent")
OUTPUT_SCHEMA: Final[dict[str, type[pl.DataType]]] = {
    "ticket_id": pl.Int64,
    "department": pl.String,
    "priority": pl.String,
    "confidence": pl.Float64,
}

#: Per department: (strong, weak) regular expressions, matched against the lower-cased
#: ``subject + " " + body``.  Score = 2 * (strong matches) + (weak matches); the highest score
#: wins, ties go to the department listed first, and a ticket with no match goes to ``other``.
#: Confidence grows with the margin between the best and second-best score.
DEPARTMENT_RULES: Final[dict[str, tuple[str, str]]] = {
    "billing": (
        r"\b(invoices?|refunds?|charged|overcharged|billing|billed|receipts?|payments?|vat"
        r"|proration|credit card|subscription)\b",
        r"\b(charges?|card|statement|price|cost|finance|accounts payable|accounting)\b",
    ),
    "technical": (
        r"\b(crash(es|ed|ing)?|errors?|bugs?|api|http|outage|sync(ing)?|webhooks?|timeouts?"
        r"|install(er)?|stack trace|integration|not loading)\b",
        r"\b(version|update|updating|cache|reinstalled|logs|down|load|unusable|blank page"
        r"|release|req_\d+|e\d{4})\b",
    ),
    "account": (
        r"\b(log ?in|logged in|password|locked|2fa|two-factor|sign-?in|email address"
        r"|delete my account|verification code|username|account ownership|merge|admin)\b",
        r"\b(accounts?|profile|spam folder|inbox|sms|workspace)\b",
    ),
    "shipping": (
        r"\b(order #\d+|shipping|shipped|package|delivered|delivery|tracking|return label"
        r"|courier|parcel|customs|shipment|ups|fedex|dhl|usps|royal mail|canada post|dpd"
        r"|depot)\b",
        r"\b(box|arrived?|damaged|address|gift|wrong item|ordered)\b",
    ),
    "sales": (
        r"\b(pricing|quotes?|demo|trial|seats|volume discount|reseller|partner(ship)?"
        r"|procurement|licenses|sales|contract|evaluat(e|ing|ion)|nonprofits|rollout)\b",
        r"\b(budget|competitor|onboarding|upgrade|enterprise plan|users|uptime"
        r"|single sign-on)\b",
    ),
    "other": (
        r"\b(feedback|feature request|journalist|press|careers|job|thank you|thanks to"
        r"|accessibility|low vision|colou?r contrast|meetup|stickers|swag|invitation|speak)\b",
        r"\b(great|good work|fan|community|design|suggestion|company|hello)\b",
    ),
}

#: Priority keywords (lower-cased text); urgent beats high beats low, otherwise normal.
#: Enterprise customers are then bumped one level (low -> normal, normal -> high).
PRIORITY_RULES: Final[dict[str, str]] = {
    "urgent": r"\b(urgent|asap|outage|completely down|blocked|data loss|immediately)\b",
    "high": (
        r"\b(refunds?|charged twice|twice|declined|locked|can't log in|cannot log in|damaged"
        r"|crash(es|ed|ing)?|not working|never shows up|hasn't shown up"
        r"|frustrated|wrong item|overcharged|lost the phone)\b"
    ),
    "low": (
        r"\b(no rush|feature request|just wanted|whenever you get a chance|stickers|swag"
        r"|journalist|careers|meetup|keep up the good work|feedback|thank you|thanks to"
        r"|quick question)\b"
    ),
}

_MINSTD: Final[int] = 2_147_483_647  # 2**31 - 1


def _ascii_words(pattern: str) -> str:
    """Use ASCII word boundaries: equivalent on ASCII text and much faster in the regex engine."""
    return pattern.replace(r"\b", r"(?-u:\b)")


class TransientModelError(RuntimeError):
    """A retryable failure of a whole model call (e.g. HTTP 503)."""


class PoisonRowError(ValueError):
    """The model rejects a batch because of specific rows; retrying the same rows never helps."""

    def __init__(self, ticket_ids: tuple[int, ...]) -> None:
        self.ticket_ids = ticket_ids
        super().__init__(
            "400 Bad Request: model could not process ticket_id(s) "
            + ", ".join(str(i) for i in ticket_ids)
        )

    def __reduce__(self) -> tuple[type[PoisonRowError], tuple[tuple[int, ...]]]:
        return (type(self), (self.ticket_ids,))


def _unit_interval(*parts: bytes) -> float:
    """Deterministic pseudo-random number in ``[0, 1)`` from byte strings (blake2b)."""
    digest = hashlib.blake2b(b"\x00".join(parts), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _jitter(ticket_id: pl.Expr, seed: int) -> pl.Expr:
    """Deterministic per-row value in ``[0, 1)`` from the ticket id and seed (integer-only)."""
    x = (ticket_id % _MINSTD + _MINSTD) % _MINSTD
    x = (x * 48_271 + seed % _MINSTD + 1) % _MINSTD
    x = (x * 48_271) % _MINSTD
    x = (x * 48_271) % _MINSTD
    return x.cast(pl.Float64) / _MINSTD


def _route_frame(batch: pl.DataFrame, seed: int) -> pl.DataFrame:
    """Apply the keyword rules to ``batch`` (vectorised; one pass per rule)."""
    has_tier = "customer_tier" in batch.columns
    tier = pl.col("customer_tier").fill_null("") if has_tier else pl.lit("")
    scores = [f"_score_{d}" for d in DEPARTMENT_RULES]
    text = pl.col("_text")
    staged = (
        batch.lazy()
        .select(
            pl.col("ticket_id").cast(pl.Int64),
            tier.alias("_tier"),
            pl.concat_str(
                [pl.col("subject").fill_null(""), pl.col("body").fill_null("")], separator=" "
            )
            .str.to_lowercase()
            .alias("_text"),
        )
        .with_columns(
            *[
                (
                    text.str.count_matches(_ascii_words(strong)) * 2
                    + text.str.count_matches(_ascii_words(weak))
                ).alias(name)
                for name, (strong, weak) in zip(scores, DEPARTMENT_RULES.values(), strict=True)
            ],
            pl.when(text.str.contains(_ascii_words(PRIORITY_RULES["urgent"])))
            .then(3)
            .when(text.str.contains(_ascii_words(PRIORITY_RULES["high"])))
            .then(2)
            .when(text.str.contains(_ascii_words(PRIORITY_RULES["low"])))
            .then(0)
            .otherwise(1)
            .alias("_level"),
        )
        .with_columns(
            pl.concat_list(scores).list.arg_max().alias("_best"),
            pl.max_horizontal(scores).alias("_top"),
        )
        .with_columns(
            pl.max_horizontal(
                [
                    pl.when(pl.col("_best") == i).then(-1).otherwise(pl.col(s))
                    for i, s in enumerate(scores)
                ]
            ).alias("_second"),
        )
    )
    top = pl.col("_top")
    margin = (top - pl.col("_second")).cast(pl.Float64)
    jitter = _jitter(pl.col("ticket_id"), seed)
    matched = (
        0.30
        + 0.65 * (1.0 - (-0.45 * margin).exp())
        - 0.05 * (pl.col("_second") > 0).cast(pl.Float64)
        + 0.05 * (jitter - 0.5)
    )
    confidence = (
        pl.when(top > 0).then(matched).otherwise(0.20 + 0.15 * jitter).clip(0.0, 1.0).round(4)
    )
    department = pl.when(top > 0).then(pl.col("_best")).otherwise(DEPARTMENTS.index("other"))
    level = pl.col("_level")
    level = (
        pl.when((pl.col("_tier") == "enterprise") & (level <= 1)).then(level + 1).otherwise(level)
    )
    return staged.select(
        pl.col("ticket_id"),
        pl.lit(pl.Series(DEPARTMENTS, dtype=pl.String)).gather(department).alias("department"),
        pl.lit(pl.Series(PRIORITIES, dtype=pl.String)).gather(level).alias("priority"),
        confidence.cast(pl.Float64).alias("confidence"),
    ).collect()


@dataclass
class FakeRouter:
    """Deterministic imitation of an LLM ticket-routing endpoint (see module docstring).

    Attributes:
        latency_ms: simulated latency per call (per batch), slept with :func:`time.sleep`.
        per_row_latency_ms: additional simulated latency per row of the batch.
        transient_error_rate: probability that a call raises :class:`TransientModelError`.
        seed: seeds transient failures and confidence jitter.
        poison_ids: ticket ids whose presence makes a call raise :class:`PoisonRowError`.
        calls: number of :meth:`route` calls made (including failed ones).
        rows_routed: number of rows returned by successful calls.
    """

    latency_ms: float = 0.0
    per_row_latency_ms: float = 0.0
    transient_error_rate: float = 0.0
    seed: int = 0
    poison_ids: frozenset[int] = frozenset()
    calls: int = field(default=0, init=False, compare=False)
    rows_routed: int = field(default=0, init=False, compare=False)
    _attempts: dict[bytes, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.transient_error_rate <= 1.0:
            raise ValueError(
                f"transient_error_rate must be in [0, 1], got {self.transient_error_rate}"
            )
        if self.latency_ms < 0 or self.per_row_latency_ms < 0:
            raise ValueError("latencies must be >= 0")
        self.poison_ids = frozenset(int(i) for i in self.poison_ids)

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _next_attempt(self, key: bytes) -> int:
        with self._lock:
            self.calls += 1
            attempt = self._attempts.get(key, 0)
            self._attempts[key] = attempt + 1
        return attempt

    def route(self, batch: pl.DataFrame) -> pl.DataFrame:
        """Route a batch of tickets.

        Args:
            batch: DataFrame with at least ``ticket_id``, ``subject`` and ``body``; an optional
                ``customer_tier`` column raises the priority of enterprise tickets.  Other
                columns are ignored.

        Returns:
            DataFrame with ``ticket_id`` (Int64), ``department`` and ``priority`` (String) and
            ``confidence`` (Float64 in [0, 1]), one row per input row, in input order.

        Raises:
            TransientModelError: randomly (see ``transient_error_rate``); retry the batch.
            PoisonRowError: if the batch contains any id in ``poison_ids``.
            ValueError: if a required column is missing.
        """
        missing = [c for c in ("ticket_id", "subject", "body") if c not in batch.columns]
        if missing:
            raise ValueError(f"batch is missing required column(s): {missing}")
        if batch.height == 0:
            return pl.DataFrame(schema=OUTPUT_SCHEMA)

        ids = batch.get_column("ticket_id").cast(pl.Int64).fill_null(-1).to_numpy()
        key = hashlib.blake2b(np.sort(ids).astype("<i8").tobytes(), digest_size=16).digest()
        attempt = self._next_attempt(key)

        delay_ms = self.latency_ms + self.per_row_latency_ms * batch.height
        if delay_ms > 0:
            time.sleep(delay_ms / 1000.0)

        if self.transient_error_rate > 0:
            u = _unit_interval(b"transient", str(self.seed).encode(), key, str(attempt).encode())
            if u < self.transient_error_rate:
                raise TransientModelError("503 Service Unavailable: model overloaded")

        if self.poison_ids:
            bad = np.isin(ids, np.fromiter(self.poison_ids, dtype=np.int64))
            if bad.any():
                raise PoisonRowError(tuple(int(i) for i in np.unique(ids[bad])))

        result = _route_frame(batch, self.seed)
        with self._lock:
            self.rows_routed += result.height
        return result
