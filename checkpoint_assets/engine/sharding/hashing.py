"""Stable, vectorised hashes: shard assignment, per-row input hashes, fingerprints.

Everything here is specified by bytes, not by a library's internal hash. So the same data gives
the same values on every machine, version and process
(``tests/engine/sharding/test_hashing.py`` pins them):

- The *text* of a value is its UTF-8 string:
    - integers in decimal (``42`` → ``b"42"``);
    - other scalars as polars casts them to ``String``: floats ``1.5``, ``NaN``, ``inf``,
      ``-inf``; times of day with their fraction of a second, ``01:02:03.5``; durations in
      ISO 8601, ``PT1.5S``;
    - binary values in hex;
    - nested values (lists, arrays, structs) as polars' JSON encoding of ``{"v": value}``, with
      binary values inside them in hex, since JSON has no bytes: ``[1.5, 2.0]`` →
      ``{"v":[1.5,2.0]}``.
- JSON has no NaN or infinity: polars writes them as ``null``, like a null float. So a nested value
  holding, at any depth, a NaN, an infinity or a null float is written with every float inside it
  as text, under the key ``floats_as_text``: ``[1.5, NaN]`` → ``{"floats_as_text":["1.5","NaN"]}``,
  ``[null]`` → ``{"floats_as_text":[null]}``, ``[inf]`` → ``{"floats_as_text":["inf"]}``. This is
  *input hash format 2*, recorded in a checkpoint's meta (``input_hash_format``). Format 1, found
  in older checkpoints, writes all of them as ``{"v":[null]}``. There, a change between NaN,
  infinities and null inside a nested input goes unseen. Every other value has the same text in
  both formats.
- ``XXH3-64`` (seed 0) of that text, computed by the ``polars-hash`` plugin, is a value's hash.
- The shard of an id among ``n`` is ``floor(h * n / 2**64)``, where ``h = xxh3_64(text(id))``.
  This is the *range rule*. Shard ``i`` holds the hashes from ``ceil(i * 2**64 / n)`` up to, not
  including, ``ceil((i + 1) * 2**64 / n)``. That is one contiguous range, so a shard of one count
  overlaps at most ``ceil(n_old / n_new) + 1`` shards of another. It is computed exactly, in
  integers. It depends on the id alone: not on the row's position, the input's length, or
  ``limit``. A checkpoint whose meta records no rule was written by the *mod rule*, ``h % n``.
  As a polars expression (``shard_key``), an id's *shard key* is ``h - 2**63`` as a signed 64-bit
  integer. It is ordered as ``h``, and within the integers every Parquet reader compares. A stored
  source keeps it in a column, so a shard's filter on it skips other row groups.
- A row's input hash folds the hashes of the id and each input column, in order, with
  ``h = (h ^ x) * 0x9E3779B97F4A7C15 (mod 2**64)``. A null folds in ``0x6E756C6C`` ("null")
  instead of a value's hash. The input hash is stored with each result and detects changed
  inputs per row.
- A row's *content key* is 128 bits: two folds of its input columns alone, in order, the id left
  out. The high half folds ``xxh3_64`` (seed 0) of each value, the low half ``xxh3_64`` with seed
  1. Both fold as the input hash does, from the same start, a null as ``0x6E756C6C``. It names
  what was asked, wherever the row is stored, so the result store keys by it (``engine/reuse/``).
  The high half is also the dedupe key: equal inputs share it.
- A partition's input fingerprint is BLAKE3 over the row count and the sum and xor of its row
  hashes. It ignores order, so re-ordering the input is not a change.
- A job fingerprint is BLAKE3 over a canonical JSON of the settings that change results.

Row hashes use XXH3 rather than BLAKE3. A 64-bit hash of either has the same chance of missing a
change (2**-64). XXH3 runs about 40 times faster here, which matters at 10**8 rows. BLAKE3 stays
where a digest is kept and compared as a whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import blake3
import numpy as np
import polars as pl
import polars_hash  # noqa: F401  (registers the ``nchash`` expression namespace)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_NULL = np.uint64(0x6E756C6C)
_SEED = np.uint64(0xC4EC)  # "checkpoint": the fold's starting value
_CHUNK_ROWS = 1 << 20
_SPACE = 1 << 64  # the hash space
MAX_SHARDS = (1 << 32) - 1  # keeps the exact shard arithmetic within uint64
# The input hash format: 2 tells NaN, infinities and null apart inside nested values; 1 does not.
HASH_FORMAT = 2
EXACT_FLOATS_KEY = "floats_as_text"


def value_text(column: str, dtype: pl.DataType, *, hash_format: int = HASH_FORMAT) -> pl.Expr:
    """The canonical text of a column's values (see the module docstring).

    ``hash_format=1``: the text of format 1, where NaN, infinities and null inside nested values
    are all JSON's ``null``. It serves only to recognise rows stored in that format.
    """
    if dtype == pl.String:
        return pl.col(column)
    if dtype == pl.Time:
        # Not a cast: polars' cast drops the fraction of a second (01:02:03.5 -> "01:02:03").
        # ``%.f`` prints no fraction when there is none, as the cast did.
        return pl.col(column).dt.to_string("%H:%M:%S%.f")
    if dtype == pl.Duration:
        return pl.col(column).dt.to_string("iso")  # polars cannot cast it; JSON writes the same
    if dtype.is_numeric() or dtype in (pl.Boolean, pl.Date, pl.Datetime):
        return pl.col(column).cast(pl.String)
    if dtype in (pl.Binary,):
        return pl.col(column).bin.encode("hex")
    if dtype == pl.Categorical or isinstance(dtype, pl.Enum):
        return pl.col(column).cast(pl.String)
    value = pl.col(column)
    text = pl.struct(_rewrite(value, dtype, _as_hex).alias("v")).struct.json_encode()
    if hash_format < 2 or not _holds(dtype, _is_float):
        return text
    # JSON has no NaN or infinity: polars writes them as null. A value holding one, or a null
    # float, has every float inside it as text, under another key. (Format 1 cannot tell these
    # apart.) So the text of every other value stays as it is in format 1.
    exact = pl.struct(_rewrite(value, dtype, _as_exact_text).alias(EXACT_FLOATS_KEY))
    return (
        pl.when(_any_unclear_float(value, dtype)).then(exact.struct.json_encode()).otherwise(text)
    )


# How a non-nested value inside a nested one is rewritten before JSON encoding (None: kept).
_Rule = Callable[[pl.DataType], Callable[[pl.Expr], pl.Expr] | None]


def _as_hex(dtype: pl.DataType) -> Callable[[pl.Expr], pl.Expr] | None:
    if dtype == pl.Binary:
        return lambda value: value.bin.encode("hex")  # JSON has no bytes
    return None


def _as_exact_text(dtype: pl.DataType) -> Callable[[pl.Expr], pl.Expr] | None:
    if dtype.is_float():
        # "NaN", "inf", "-inf", and the shortest round-trip digits of any other float
        return lambda value: value.cast(pl.String)
    return _as_hex(dtype)


def _is_float(dtype: pl.DataType) -> bool:
    return dtype.is_float()


def _holds(dtype: pl.DataType, leaf: Callable[[pl.DataType], bool]) -> bool:
    """Whether ``dtype`` is, or holds at any depth, a type that ``leaf`` accepts."""
    if isinstance(dtype, pl.List | pl.Array):
        return _holds(dtype.inner, leaf)  # type: ignore[arg-type]
    if isinstance(dtype, pl.Struct):
        return any(_holds(f.dtype, leaf) for f in dtype.fields)  # type: ignore[arg-type]
    return leaf(dtype)


def _rewrite(expr: pl.Expr, dtype: pl.DataType, rule: _Rule) -> pl.Expr:
    """``expr`` with every non-nested value inside it rewritten by ``rule``."""
    if not _holds(dtype, lambda d: rule(d) is not None):
        return expr
    if isinstance(dtype, pl.List | pl.Array):
        items = expr.arr.to_list() if isinstance(dtype, pl.Array) else expr
        return items.list.eval(_rewrite(pl.element(), dtype.inner, rule))  # type: ignore[arg-type]
    if isinstance(dtype, pl.Struct):
        fields = [
            _rewrite(expr.struct.field(f.name), f.dtype, rule).alias(f.name)  # type: ignore[arg-type]
            for f in dtype.fields
        ]
        # A null struct stays null, not a struct of null fields: they are different values.
        return pl.when(expr.is_null()).then(None).otherwise(pl.struct(fields))
    rewrite = rule(dtype)
    assert rewrite is not None
    return rewrite(expr)


def _any_unclear_float(expr: pl.Expr, dtype: pl.DataType) -> pl.Expr:
    """True where a value holds, at any depth, a NaN, an infinity or a null float."""
    if isinstance(dtype, pl.List | pl.Array):
        items = expr.arr.to_list() if isinstance(dtype, pl.Array) else expr
        inner = _any_unclear_float(pl.element(), dtype.inner)  # type: ignore[arg-type]
        return items.list.eval(inner).list.any().fill_null(False)
    if isinstance(dtype, pl.Struct):
        fields = [
            _any_unclear_float(expr.struct.field(f.name), f.dtype)  # type: ignore[arg-type]
            for f in dtype.fields
            if _holds(f.dtype, _is_float)  # type: ignore[arg-type]
        ]
        return pl.when(expr.is_null()).then(False).otherwise(pl.any_horizontal(fields))
    return expr.is_finite().not_().fill_null(True)  # a float: null, NaN, inf or -inf


def xxh3(df: pl.DataFrame, column: str) -> np.ndarray:
    """XXH3-64 of a column's canonical text, as uint64 (nulls become 0 and must be masked)."""
    out = np.empty(df.height, dtype=np.uint64)
    expr = _text_hash(column, df.schema[column]).fill_null(0)
    for start, hashes in _by_chunk(df, [expr]):
        out[start : start + hashes.height] = hashes.to_series().to_numpy()
    return out


def shard_of(ids: pl.Series, n: int) -> np.ndarray:
    """The shard (0..n-1) of each id: ``floor(xxh3_64(text(id)) * n / 2**64)``."""
    return shard_of_hashes(xxh3(ids.to_frame("id"), "id"), n)


def shard_of_hashes(hashes: np.ndarray, n: int) -> np.ndarray:
    """``floor(h * n / 2**64)`` of each uint64 ``h``, exactly.

    With ``h = hi * 2**32 + lo``: ``h * n / 2**64 = (hi * n + lo * n / 2**32) / 2**32``. The
    inner division may be floored first, since ``hi * n`` is an integer. Every product stays below
    ``2**64`` for ``n < 2**32``, so uint64 arithmetic never wraps.
    """
    if not 1 <= n <= MAX_SHARDS:
        raise ValueError(f"shard count must be between 1 and {MAX_SHARDS}, got {n}")
    count = np.uint64(n)
    hi = hashes >> np.uint64(32)
    lo = hashes & np.uint64(0xFFFFFFFF)
    lo *= count
    lo >>= np.uint64(32)
    hi *= count
    hi += lo
    hi >>= np.uint64(32)
    return hi.astype(np.int64)


def shard_bounds(index: int, n: int) -> tuple[int, int]:
    """The hashes of shard ``index`` of ``n``: ``[first, end)``, as Python integers."""
    return -(-index * _SPACE // n), -(-(index + 1) * _SPACE // n)


def overlapping(index: int, n: int, other: int) -> range:
    """The shards of ``other`` whose hashes overlap those of shard ``index`` of ``n``."""
    first, end = shard_bounds(index, n)
    return range(first * other // _SPACE, (end - 1) * other // _SPACE + 1)


def shard_key(column: str, dtype: pl.DataType) -> pl.Expr:
    """The shard key of each id in ``column`` (``h - 2**63`` as Int64), computed by polars.

    A null id has key ``-2**63`` (``h = 0``), as ``shard_of`` puts it in shard 0. The shard's run
    then reports it rather than losing it.
    """
    flipped = _text_hash(column, dtype).fill_null(0) ^ pl.lit(1 << 63, pl.UInt64)
    return flipped.reinterpret(signed=True)


def shard_key_bounds(index: int, n: int) -> tuple[int, int | None]:
    """The shard keys of shard ``index`` of ``n``: ``[first, end)``, ``end`` None for the last."""
    first, end = shard_bounds(index, n)
    return first - (1 << 63), (end - (1 << 63) if end < _SPACE else None)


def row_hashes(
    df: pl.DataFrame, columns: Sequence[str], *, hash_format: int = HASH_FORMAT, seed: int = 0
) -> np.ndarray:
    """The input hash of each row over ``columns`` (id first, then the input columns).

    ``hash_format=1``: the hash of format 1 (see ``value_text``). ``seed``: of each value's
    ``xxh3_64`` (1 for the low half of a content key).
    """
    exprs = [
        pl.when(pl.col(c).is_null())
        .then(pl.lit(_NULL, pl.UInt64))
        .otherwise(_text_hash(c, df.schema[c], hash_format, seed))
        .alias(f"__hash{i}")
        for i, c in enumerate(columns)
    ]
    out = np.empty(df.height, dtype=np.uint64)
    for start, hashes in _by_chunk(df, exprs):
        h = out[start : start + hashes.height]
        h.fill(_SEED)
        for x in hashes.iter_columns():  # the fold, in place: no temporaries of the full size
            np.bitwise_xor(h, x.to_numpy(), out=h)
            np.multiply(h, _GOLDEN, out=h)
    return out


def content_keys(df: pl.DataFrame, columns: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The content key of each row over its input ``columns`` (no id): high and low halves."""
    return row_hashes(df, columns), row_hashes(df, columns, seed=1)


def _text_hash(
    column: str, dtype: pl.DataType, hash_format: int = HASH_FORMAT, seed: int = 0
) -> pl.Expr:
    text = value_text(column, dtype, hash_format=hash_format)
    return text.nchash.xxh3_64(seed=seed)  # type: ignore[attr-defined, no-any-return]


def _by_chunk(df: pl.DataFrame, exprs: list[pl.Expr]) -> Iterator[tuple[int, pl.DataFrame]]:
    """``exprs`` over slices of ``_CHUNK_ROWS`` rows.

    Each chunk's canonical text is a new string column (an integer id's decimal text, say).
    Building it a chunk at a time keeps memory flat at 10**8 rows.
    """
    for start in range(0, df.height, _CHUNK_ROWS):
        yield start, df.slice(start, _CHUNK_ROWS).select(exprs)


def fingerprint(hashes: np.ndarray) -> str:
    """BLAKE3 fingerprint of a partition's row hashes, independent of row order."""
    with np.errstate(over="ignore"):
        total = np.sum(hashes, dtype=np.uint64) if hashes.size else np.uint64(0)
    xor = np.bitwise_xor.reduce(hashes) if hashes.size else np.uint64(0)
    summary = np.array([hashes.size, total, xor], dtype=np.uint64).tobytes()
    return blake3.blake3(summary).hexdigest()[:32]


def job_fingerprint(settings: dict[str, Any]) -> str:
    """BLAKE3 of the canonical JSON of the result-changing settings."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return blake3.blake3(text.encode()).hexdigest()[:32]
