"""Deterministic, vectorised generator of realistic customer-support tickets.

``generate_tickets(n, seed)`` returns a :class:`polars.DataFrame` with one row per ticket:

* ``ticket_id`` (Int64): ``1..n``, unique.
* ``subject`` (String): a short subject line.
* ``body`` (String): one to four sentences.
* ``customer_tier`` (String): ``free`` / ``pro`` / ``enterprise``.
* ``true_department`` (String): the department whose templates produced the ticket
  (``billing`` / ``technical`` / ``account`` / ``shipping`` / ``sales`` / ``other``), useful for
  measuring routing accuracy.

Texts are assembled from per-department templates (subject, main sentence, detail sentences)
plus department-neutral "generic" sentences.  Placeholders such as ``{product}``, ``{order}`` or
``{amount}`` are filled from vocabularies and integer ranges.  Within one ticket a placeholder
always has the same value (the order number in the subject matches the one in the body).

Speed: there is no per-row Python code.  Every template is pre-split at import time into
``literal, slot, literal, slot, ...``.  Per row, numpy draws integers only (template indices and
one 64-bit "value seed" from which every placeholder value is derived by multiply-shift hashing);
polars then renders strings with gathers from small literal/vocabulary series and one
``concat_str`` per text column.  Work is done block by block to keep memory and caches small.

Determinism: randomness comes from the raw 64-bit output of the PCG64 bit generator
(``np.random.default_rng([seed, block]).bit_generator.random_raw``), turned into choices with
integer arithmetic only: no floats, no ``Generator`` distribution methods (whose algorithms numpy
reserves the right to change), no hashing of Python objects, no set iteration.  Rows are
generated in fixed blocks of ``BLOCK_SIZE`` seeded by ``(seed, block_index)`` and the last block
is cut, so row ``i`` never depends on ``n``: ``generate_tickets(10)[:5]`` equals
``generate_tickets(100)[:5]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import polars as pl

__all__ = ["BLOCK_SIZE", "DEPARTMENTS", "SCHEMA", "TIERS", "generate_tickets"]

DEPARTMENTS: Final[tuple[str, ...]] = (
    "billing",
    "technical",
    "account",
    "shipping",
    "sales",
    "other",
)
TIERS: Final[tuple[str, ...]] = ("free", "pro", "enterprise")
SCHEMA: Final[dict[str, type[pl.DataType]]] = {
    "ticket_id": pl.Int64,
    "subject": pl.String,
    "body": pl.String,
    "customer_tier": pl.String,
    "true_department": pl.String,
}

#: Rows per independently seeded block.  Part of the output contract: changing it changes data.
BLOCK_SIZE: Final[int] = 65_536

_U64 = npt.NDArray[np.uint64]
_I64 = npt.NDArray[np.int64]

# Relative frequency of each department, and P(tier | department).
_DEPT_WEIGHTS: Final[tuple[int, ...]] = (24, 28, 18, 13, 9, 8)
_TIER_WEIGHTS: Final[dict[str, tuple[int, ...]]] = {
    "billing": (45, 40, 15),
    "technical": (48, 34, 18),
    "account": (60, 30, 10),
    "shipping": (55, 35, 10),
    "sales": (50, 30, 20),
    "other": (70, 22, 8),
}
# P(number of body sentences = 1, 2, 3, 4).
_SENTENCE_WEIGHTS: Final[tuple[int, ...]] = (20, 35, 30, 15)

# --------------------------------------------------------------------------------------------
# Placeholder values
# --------------------------------------------------------------------------------------------

_MONTHS: Final[tuple[str, ...]] = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)

_NAMES: Final[tuple[str, ...]] = (
    "Priya",
    "Marco",
    "Aisha",
    "Tom",
    "Lena",
    "Kenji",
    "Sofia",
    "Daniel",
    "Fatima",
)
_DATES: Final[tuple[str, ...]] = tuple(f"{m} {d}" for m in _MONTHS for d in range(1, 29))

#: Placeholders filled from a word list.  Within a ticket each placeholder name has one value.
_WORDS: Final[dict[str, tuple[str, ...]]] = {
    "product": (
        "Acme Cloud Drive",
        "Acme Sync",
        "Nimbus CRM",
        "Helix Analytics",
        "Orbit Mobile",
        "PixelForge Studio",
        "Atlas Gateway",
        "Beacon Monitor",
        "Quill Docs",
        "Lumen Scheduler",
    ),
    "hwproduct": (
        "Acme Hub router",
        "Acme Smart Scanner",
        "Acme Desk Dock",
        "Acme Label Printer",
        "Acme Mesh Extender",
        "Acme Conference Camera",
        "Acme Badge Reader",
        "Acme Wireless Keyboard",
    ),
    "plan": ("Starter", "Pro", "Team", "Business", "Premium"),
    "carrier": ("UPS", "FedEx", "DHL", "USPS", "Royal Mail", "Canada Post", "DPD"),
    "platform": (
        "Chrome on Windows 11",
        "Safari on macOS Sonoma",
        "Firefox on Ubuntu 22.04",
        "Edge on Windows 10",
        "the iOS app",
        "the Android app",
        "the desktop app on macOS",
    ),
    "feature": (
        "CSV export",
        "bulk import",
        "the reporting dashboard",
        "scheduled reports",
        "the calendar view",
        "file previews",
        "global search",
        "the notification center",
        "the audit trail",
        "shared folders",
    ),
    "integration": (
        "Salesforce",
        "Slack",
        "Zapier",
        "HubSpot",
        "Google Drive",
        "Microsoft Teams",
        "Shopify",
        "QuickBooks",
    ),
    "city": (
        "Austin",
        "Leeds",
        "Toronto",
        "Berlin",
        "Melbourne",
        "Denver",
        "Lyon",
        "Dublin",
        "Rotterdam",
        "Chicago",
    ),
    "http": ("500", "502", "503", "504", "403", "401", "429"),
    "version": ("4.2.1", "4.3.0", "4.3.2", "5.0.0", "5.0.2", "5.1.0"),
    "name": _NAMES,
    "signer": _NAMES,  # a second, independent name (sign-off)
    "month": _MONTHS,
    "date": _DATES,
    "date2": _DATES,  # a second, independent date
    # Money in dollars and cents, $4.99 .. $499.99.
    "amount": tuple(f"{c // 100}.{c % 100:02d}" for c in range(499, 50_000)),
}
#: Placeholders filled with an integer from an inclusive range.
_RANGES: Final[dict[str, tuple[int, int]]] = {
    "order": (1_000_000, 9_999_999),
    "invoice": (10_000, 99_999),
    "errnum": (1000, 9999),
    "seats": (5, 400),
    "days": (2, 21),
    "last4": (1000, 9999),
    "tracking": (100_000_000, 999_999_999),
    "count": (2, 12),
    "year": (2015, 2024),
    "quote": (1500, 90_000),
}

# --------------------------------------------------------------------------------------------
# Templates (``{name}`` is a placeholder from _WORDS or _RANGES)
# --------------------------------------------------------------------------------------------

_SUBJECTS: Final[dict[str, tuple[str, ...]]] = {
    "billing": (
        "Charged twice for my {plan} subscription",
        "Refund request for invoice INV-{invoice}",
        "Question about invoice INV-{invoice}",
        "Unexpected charge of ${amount} on my card",
        "Payment failed for {product}",
        "Need a receipt for my last payment",
        "Billing error on my {month} statement",
        "Cancel subscription and refund",
        "Update credit card ending in {last4}",
        "VAT missing from invoice",
        "Overcharged after downgrading to {plan}",
    ),
    "technical": (
        "{product} keeps crashing on {platform}",
        "Error E{errnum} when syncing with {integration}",
        "API returns {http} errors",
        "Outage: {product} not loading",
        "Webhook deliveries failing since version {version}",
        "Sync stuck for {count} hours",
        "Bug: wrong numbers in {feature}",
        "Timeout errors in {product}",
        "Cannot install {product} {version}",
        "{integration} integration broken",
    ),
    "account": (
        "Can't log in to my account",
        "Password reset email never arrives",
        "Locked out after too many attempts",
        "Change the email address on my account",
        "Lost phone, need help with two-factor authentication",
        "Please delete my account",
        "Add {name} as an admin",
        "Username already taken",
        "Merge two accounts",
        "Verification code not working",
    ),
    "shipping": (
        "Where is my order #{order}?",
        "Package marked delivered but not received",
        "Order #{order} arrived damaged",
        "Tracking number not updating",
        "Wrong item shipped in order #{order}",
        "Need a return label for the {hwproduct}",
        "Change delivery address for order #{order}",
        "Shipping delay on order #{order}",
        "{carrier} says the package was returned to sender",
    ),
    "sales": (
        "Pricing for {seats} seats",
        "Request a demo of {product}",
        "Quote for a {seats}-user rollout",
        "Volume discount for nonprofits",
        "Extending our trial",
        "Upgrade from {plan} to Enterprise",
        "Reseller partnership",
        "Annual contract for {product}",
        "Procurement questions from our legal team",
    ),
    "other": (
        "Feedback on the new design",
        "Feature request: {feature}",
        "Press inquiry",
        "Job application follow-up",
        "Thank you!",
        "Accessibility suggestion",
        "Question about your company",
        "Speaking invitation",
        "Hello from {city}",
    ),
}

#: Vague subjects any department can use (about a quarter of all tickets).
_GENERIC_SUBJECTS: Final[tuple[str, ...]] = (
    "Quick question",
    "Need help",
    "Issue with {product}",
    "Following up on my previous message",
)

_MAIN: Final[dict[str, tuple[str, ...]]] = {
    "billing": (
        "I was charged ${amount} twice on {date} for the same {plan} subscription.",
        "Invoice INV-{invoice} shows ${amount}, but our {plan} plan should cost less than that.",
        "My payment with the card ending in {last4} was declined even though the card is valid.",
        "I cancelled {product} on {date} but was still charged ${amount} this month.",
        "Could you please issue a refund of ${amount} for the unused part of my subscription?",
        "I need a copy of the receipt for invoice INV-{invoice} for our accounting team.",
        "After downgrading to the {plan} plan we were billed ${amount}, "
        "which looks like a proration mistake.",
        "Our company VAT number is missing from invoice INV-{invoice}.",
        "The billing page says my payment of ${amount} is still pending after {days} days.",
        "Please switch our billing from monthly to annual and tell me the new price.",
        "Your pricing page lists the {plan} plan for less than what we pay every month.",
    ),
    "technical": (
        "Every time I open {feature} in {product} on {platform}, the app crashes.",
        "Since updating to version {version}, syncing with {integration} fails "
        "with error E{errnum}.",
        "Our API calls to {product} have been returning HTTP {http} for the last {count} hours.",
        "{product} is completely down for our team and only shows a blank page.",
        "The {integration} integration stopped importing records after yesterday's update.",
        "Webhook deliveries are failing with a timeout after {count} seconds.",
        "The installer for {product} {version} stops with error E{errnum}.",
        "Pages in {product} take more than {count} seconds to load, which makes it unusable.",
        "The numbers in {feature} come from the wrong date range; this looks like a bug.",
        "We are seeing a full outage of {product} across all of our offices.",
        "The payment form in {product} throws error E{errnum} when our customers check out.",
    ),
    "account": (
        "I can't log in to my account; it says my password is incorrect even after a reset.",
        "The password reset link I requested {count} times never shows up in my inbox.",
        "My account was locked after too many failed sign-in attempts.",
        "I need to change the email address on my account because I moved to a new company.",
        "I lost the phone I used for two-factor authentication and can't get 2FA codes anymore.",
        "Please delete my account and all associated personal data.",
        "Could you transfer account ownership from {name} to me, since {name} has left the team?",
        "I want to merge my two accounts into one profile.",
        "The verification code you send by SMS expires before it arrives.",
        "I'd like to add {name} as an admin user on our workspace.",
        "We were charged for a seat for {name}, who no longer has an account with us.",
    ),
    "shipping": (
        "My order #{order} for the {hwproduct} was supposed to arrive {days} days ago "
        "and still hasn't shown up.",
        "{carrier} marked the package as delivered on {date}, "
        "but nothing arrived at my address in {city}.",
        "The {hwproduct} in order #{order} arrived damaged; the box was crushed.",
        "The tracking number 1Z{tracking} has not updated in {days} days.",
        "I received the wrong item in order #{order}; it should have been a {hwproduct}.",
        "Please send me a return label so I can send back the {hwproduct}.",
        "Can you change the delivery address for order #{order} to our new office in {city}?",
        "The courier came while our office was closed and the package is now at a {carrier} depot.",
        "Order #{order} is stuck in customs and {carrier} is asking for an import fee.",
        "I was charged ${amount} for express delivery, but it came by regular mail.",
    ),
    "sales": (
        "We are evaluating {product} for a team of {seats} people and would like a quote.",
        "Could we schedule a demo of {product} for our leadership team next week?",
        "What volume discount do you offer for {seats} seats on an annual contract?",
        "Our trial ends in {days} days; can it be extended so we can finish the evaluation?",
        "We'd like to upgrade from {plan} to the Enterprise plan and need pricing "
        "for {seats} users.",
        "Do you offer a reseller or partner program in {city}?",
        "Our procurement team needs a formal quote of around ${quote} before we can sign.",
        "Is there special pricing for nonprofits and schools?",
        "I'd like to talk to someone in sales about moving our {seats} licenses to your platform.",
    ),
    "other": (
        "I just wanted to say that {feature} is great and saves me a lot of time.",
        "It would be great if {feature} could be customised; consider this a feature request.",
        "I'm a journalist writing a story about productivity tools and would love to ask "
        "a few questions.",
        "I applied for a job on your careers page on {date} and wanted to follow up.",
        "Thanks to {name} from your team for the excellent help last week.",
        "The colour contrast in {feature} is hard to read for people with low vision.",
        "Are you planning to open an office in {city}?",
        "We would like to invite someone from your company to speak at our meetup in {city}.",
        "Do you have any stickers or swag for our community event?",
        "Your team fixed my login problem within minutes, thank you!",
    ),
}

_DETAILS: Final[dict[str, tuple[str, ...]]] = {
    "billing": (
        "I have attached a screenshot of my bank statement.",
        "We have been paying customers since {year} and this never happened before.",
        "The card ending in {last4} is the only payment method on file.",
        "Our finance team needs this sorted out before the end of {month}.",
        "I can't find the invoice anywhere in my account settings.",
        "The amount should have been ${amount} according to your pricing page.",
        "Please send the corrected invoice to our accounts payable address.",
    ),
    "technical": (
        "I already cleared the cache and reinstalled, but the error persists.",
        "The stack trace mentions a null reference in the sync module.",
        "It happens on {platform} as well.",
        "Restarting the app fixes it for a few minutes only.",
        "The logs show error E{errnum} right before it fails.",
        "This started right after the {version} release.",
        "Around {count} of my colleagues see the same behaviour.",
        "The request ID from the failed call is req_{order}.",
    ),
    "account": (
        "I've checked the spam folder already.",
        "My username is the same as my work email.",
        "I last logged in successfully on {date2}.",
        "I'm using {platform}.",
        "Our admin {name} is on leave, so I can't ask them.",
        "I've had this profile since {year}.",
    ),
    "shipping": (
        "I ordered it on {date2}.",
        "The shipment was sent with {carrier}.",
        "It's a gift, so we need it before {date2}.",
        "I can send photos of the damaged box.",
        "Nobody in the building received a parcel that day.",
        "The order confirmation number is #{order}.",
    ),
    "sales": (
        "We currently use a competitor and our contract ends in {month}.",
        "Budget is approved for this quarter.",
        "We would need single sign-on and an uptime guarantee.",
        "Please include onboarding in the quote.",
        "My colleague {name} will join the call.",
    ),
    "other": (
        "Keep up the good work.",
        "Happy to share more details if useful.",
        "I've been a fan since {year}.",
        "My colleague {name} agrees.",
    ),
}

_GENERIC: Final[tuple[str, ...]] = (
    # Ordered: when several extra sentences are drawn they keep pool order, so department
    # details come first and closing lines ("Thanks in advance.") come last.
    "I've contacted you {count} times already about this.",
    "I'm a bit frustrated, to be honest.",
    "This is urgent, our whole team is blocked.",
    "We need this resolved this week.",
    "Could you get back to me by {date2}?",
    "Please let me know as soon as possible.",
    "No rush, whenever you get a chance.",
    "Any help would be appreciated.",
    "Thanks in advance.",
    "Best regards, {signer}.",
)

# --------------------------------------------------------------------------------------------
# Compiled tables (built once at import)
# --------------------------------------------------------------------------------------------

_PLACEHOLDER_RE: Final[re.Pattern[str]] = re.compile(r"\{([a-z0-9_]+)\}")


@dataclass(frozen=True)
class _SlotTypes:
    """Per placeholder type (index = slot type id; id 0 is "no placeholder")."""

    names: tuple[str, ...]
    is_int: npt.NDArray[np.bool_]  # rendered by casting the value, not by a vocabulary gather
    vocab_offset: npt.NDArray[np.uint64]
    low: npt.NDArray[np.uint64]
    span: npt.NDArray[np.uint64]  # number of distinct values
    mult: npt.NDArray[np.uint64]  # odd multiplier deriving this type's value from the row seed
    vocab: pl.Series  # "" followed by every word list


def _odd_constant(i: int) -> int:
    """A fixed, well-mixed odd 64-bit constant (splitmix64 of ``i``)."""
    z = (i * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) | 1


def _build_slot_types() -> _SlotTypes:
    names = [""]
    is_int = [False]
    offset = [0]
    low = [0]
    span = [1]
    words = [""]
    for name, values in _WORDS.items():
        names.append(name)
        is_int.append(False)
        offset.append(len(words))
        low.append(0)
        span.append(len(values))
        words.extend(values)
    for name, (lo, hi) in _RANGES.items():
        names.append(name)
        is_int.append(True)
        offset.append(0)
        low.append(lo)
        span.append(hi - lo + 1)
    assert max(span) < 2**32
    return _SlotTypes(
        names=tuple(names),
        is_int=np.array(is_int, dtype=np.bool_),
        vocab_offset=np.array(offset, dtype=np.uint64),
        low=np.array(low, dtype=np.uint64),
        span=np.array(span, dtype=np.uint64),
        mult=np.array([_odd_constant(i) for i in range(len(names))], dtype=np.uint64),
        vocab=pl.Series("vocab", words, dtype=pl.String),
    )


_SLOTS: Final[_SlotTypes] = _build_slot_types()
_SLOT_ID: Final[dict[str, int]] = {name: i for i, name in enumerate(_SLOTS.names) if name}


@dataclass(frozen=True)
class _Pool:
    """Templates of one kind: a contiguous run in the piece table per department."""

    offset: npt.NDArray[np.uint64]  # per department
    count: npt.NDArray[np.uint64]  # per department
    max_slots: int


@dataclass(frozen=True)
class _PieceTable:
    """All templates split into ``lit0 slot1 lit1 slot2 lit2 ...`` (missing slots are 0)."""

    literals: tuple[pl.Series, ...]  # max_slots + 1 series, each with one entry per piece
    slots: npt.NDArray[np.int64]  # shape (max_slots, n_pieces)
    subject: _Pool
    main: _Pool
    extra: _Pool  # department details then generic sentences, with a leading space
    empty: int  # index of the empty piece (unused sentence positions)


def _build_piece_table() -> _PieceTable:
    pieces: list[tuple[list[str], list[int]]] = []

    def add_pool(groups: list[list[str]], prefix: str = "") -> _Pool:
        offsets: list[int] = []
        counts: list[int] = []
        first = len(pieces)
        for group in groups:
            offsets.append(len(pieces))
            counts.append(len(group))
            for template in group:
                parts = _PLACEHOLDER_RE.split(prefix + template)
                pieces.append((parts[0::2], [_SLOT_ID[name] for name in parts[1::2]]))
        return _Pool(
            offset=np.array(offsets, dtype=np.uint64),
            count=np.array(counts, dtype=np.uint64),
            max_slots=max(len(slots) for _, slots in pieces[first:]),
        )

    subject = add_pool([list(_SUBJECTS[d]) + list(_GENERIC_SUBJECTS) for d in DEPARTMENTS])
    main = add_pool([list(_MAIN[d]) for d in DEPARTMENTS])
    extra = add_pool([list(_DETAILS[d]) + list(_GENERIC) for d in DEPARTMENTS], prefix=" ")
    empty = len(pieces)
    pieces.append(([""], []))

    n_slots = max(subject.max_slots, main.max_slots, extra.max_slots)
    literals = [[""] * len(pieces) for _ in range(n_slots + 1)]
    slots = np.zeros((n_slots, len(pieces)), dtype=np.int64)
    for p, (lits, slot_ids) in enumerate(pieces):
        for j, lit in enumerate(lits):
            literals[j][p] = lit
        slots[: len(slot_ids), p] = slot_ids
    return _PieceTable(
        literals=tuple(
            pl.Series(f"lit{j}", lits, dtype=pl.String) for j, lits in enumerate(literals)
        ),
        slots=slots,
        subject=subject,
        main=main,
        extra=extra,
        empty=empty,
    )


_PIECES: Final[_PieceTable] = _build_piece_table()


def _cdf32(weights: tuple[int, ...]) -> npt.NDArray[np.uint64]:
    """Cumulative thresholds on a 2**32 scale (integer-only, so platform independent)."""
    total = sum(weights)
    acc = 0
    out: list[int] = []
    for w in weights:
        acc += w
        out.append(acc * 2**32 // total)
    return np.array(out, dtype=np.uint64)


_DEPT_CDF: Final[npt.NDArray[np.uint64]] = _cdf32(_DEPT_WEIGHTS)
_TIER_CDF: Final[npt.NDArray[np.uint64]] = np.stack(
    [_cdf32(_TIER_WEIGHTS[d]) for d in DEPARTMENTS]
)  # shape (n_departments, n_tiers)
_SENTENCE_CDF: Final[npt.NDArray[np.uint64]] = _cdf32(_SENTENCE_WEIGHTS)
_DEPARTMENT_SERIES: Final[pl.Series] = pl.Series("department", DEPARTMENTS, dtype=pl.String)
_TIER_SERIES: Final[pl.Series] = pl.Series("tier", TIERS, dtype=pl.String)

# --------------------------------------------------------------------------------------------
# Block generation
# --------------------------------------------------------------------------------------------

_S32: Final = np.uint64(32)
_N_DRAWS: Final[int] = 8  # rows of raw 64-bit draws per block; fixed for stability


def _high(r: _U64) -> _U64:
    """Top 32 bits of uniform 64-bit values (uniform on ``[0, 2**32)``)."""
    return r >> _S32


def _bounded(r32: _U64, k: _U64) -> _U64:
    """Map 32-bit uniform values to ``[0, k)`` by multiply-shift (``k < 2**32``)."""
    return (r32 * k) >> _S32


def _bucket(r32: _U64, cdf: npt.NDArray[np.uint64]) -> _I64:
    """Weighted choice: index of the first cdf threshold strictly above ``r32``."""
    return np.searchsorted(cdf, r32, side="right").astype(np.int64)


class _Renderer:
    """Collects integer columns (numpy) and the polars expressions that render text from them."""

    def __init__(self, base: _U64) -> None:
        self.base = base
        self.columns: dict[str, npt.NDArray[np.generic]] = {}

    def col(self, values: npt.NDArray[np.generic]) -> pl.Expr:
        name = f"c{len(self.columns)}"
        self.columns[name] = values
        return pl.col(name)

    def piece(self, piece: _I64, max_slots: int) -> list[pl.Expr]:
        """Expressions whose row-wise concatenation renders template ``piece[row]``."""
        t = _PIECES
        s = _SLOTS
        idx = self.col(piece.astype(np.uint32))
        parts: list[pl.Expr] = [pl.lit(t.literals[0]).gather(idx)]
        for j in range(max_slots):
            st = t.slots[j][piece]
            # The value depends on the row seed and the slot *type* only, so a placeholder that
            # occurs twice in a ticket (subject and body) gets the same value.
            r = _high(self.base * s.mult[st])
            value = s.low[st] + _bounded(r, s.span[st])
            is_int = s.is_int[st]
            word_idx = np.where(is_int, np.uint64(0), s.vocab_offset[st] + value)
            word = pl.lit(s.vocab).gather(self.col(word_idx.astype(np.uint32)))
            if is_int.any():
                number = self.col(value.astype(np.int64)).cast(pl.String)
                word = pl.when(self.col(is_int)).then(number).otherwise(word)
            parts.append(word)
            parts.append(pl.lit(t.literals[j + 1]).gather(idx))
        return parts


def _block(seed: int, block: int, rows: int) -> pl.DataFrame:
    """The first ``rows`` rows of block ``block`` (rows do not depend on ``rows``)."""
    raw = np.random.default_rng([seed, block]).bit_generator.random_raw((_N_DRAWS, BLOCK_SIZE))
    raw = np.asarray(raw, dtype=np.uint64)[:, :rows]
    p = _PIECES

    dept = _bucket(_high(raw[0]), _DEPT_CDF)
    tier_u = raw[0] & np.uint64(0xFFFF_FFFF)
    tier = (tier_u[:, None] >= _TIER_CDF[dept]).sum(axis=1)
    n_sent = _bucket(_high(raw[1]), _SENTENCE_CDF) + 1
    subject = (p.subject.offset[dept] + _bounded(_high(raw[2]), p.subject.count[dept])).astype(
        np.int64
    )
    main = (p.main.offset[dept] + _bounded(_high(raw[3]), p.main.count[dept])).astype(np.int64)

    # Up to three extra sentences from the department's extra pool (size m): pairwise distinct,
    # and emitted in pool order so that details precede generic closing lines.
    m = p.extra.count[dept]
    i2 = _bounded(_high(raw[4]), m)
    i3 = (i2 + np.uint64(1) + _bounded(_high(raw[5]), m - np.uint64(1))) % m
    lo = np.minimum(i2, i3)
    hi = np.maximum(i2, i3)
    i4 = _bounded(_high(raw[6]), m - np.uint64(2))
    i4 = i4 + (i4 >= lo)
    i4 = i4 + (i4 >= hi)
    three = np.sort(np.stack([i2, i3, i4]), axis=0)
    picks = (
        np.where(n_sent == 3, lo, np.where(n_sent == 4, three[0], i2)),
        np.where(n_sent == 3, hi, three[1]),
        three[2],
    )
    extras = [
        np.where(n_sent >= k, (p.extra.offset[dept] + idx).astype(np.int64), np.int64(p.empty))
        for k, idx in zip((2, 3, 4), picks, strict=True)
    ]

    render = _Renderer(raw[7])
    subject_parts = render.piece(subject, p.subject.max_slots)
    body_parts = render.piece(main, p.main.max_slots)
    for extra in extras:
        body_parts += render.piece(extra, p.extra.max_slots)
    tier_idx = render.col(tier.astype(np.uint32))
    dept_idx = render.col(dept.astype(np.uint32))
    first_id = block * BLOCK_SIZE + 1
    return pl.DataFrame(render.columns).select(
        pl.int_range(first_id, first_id + rows, dtype=pl.Int64).alias("ticket_id"),
        pl.concat_str(subject_parts).alias("subject"),
        pl.concat_str(body_parts).alias("body"),
        pl.lit(_TIER_SERIES).gather(tier_idx).alias("customer_tier"),
        pl.lit(_DEPARTMENT_SERIES).gather(dept_idx).alias("true_department"),
    )


def generate_tickets(n: int = 100_000, seed: int = 7) -> pl.DataFrame:
    """Generate ``n`` deterministic, realistic customer-support tickets.

    Args:
        n: number of rows; ``ticket_id`` runs ``1..n``.
        seed: non-negative seed.  The same ``(n, seed)`` gives byte-identical output on every
            machine, and row ``i`` is the same for every ``n > i``.

    Returns:
        DataFrame with columns ``ticket_id`` (Int64), ``subject``, ``body``, ``customer_tier``
        and ``true_department`` (String), see :data:`SCHEMA`; one memory chunk per
        ``BLOCK_SIZE`` rows (call ``.rechunk()`` if a single chunk is needed).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if n == 0:
        return pl.DataFrame(schema=SCHEMA)
    blocks = [
        _block(seed, b, min(BLOCK_SIZE, n - b * BLOCK_SIZE)) for b in range(-(-n // BLOCK_SIZE))
    ]
    return pl.concat(blocks, rechunk=False)
