"""Stable hashes: the same bytes give the same values everywhere, forever.

The values below were computed once and are pinned: a change here moves rows between shards
and invalidates every stored checkpoint, so it must be a deliberate, documented format change.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from checkpoint_assets.engine import hashing


def test_shard_of_integer_ids_is_pinned() -> None:
    ids = pl.Series("id", [0, 1, 2, 42, 1_000_000_007])

    assert hashing.shard_of(ids, 16).tolist() == PINNED_16
    assert hashing.shard_of(ids, 4).tolist() == PINNED_4


PINNED_16 = [1, 6, 15, 1, 11]  # the README's table
PINNED_4 = [0, 1, 3, 0, 2]


def test_shard_of_string_ids_is_pinned() -> None:
    ids = pl.Series("id", ["a", "ticket-1", "ünïcode", ""])

    assert hashing.shard_of(ids, 16).tolist() == [14, 11, 11, 2]


# Hashes at the edges of the 64-bit space and of its 32-bit halves, where a vectorised
# floor(h * n / 2**64) that overflowed or rounded would show.
EDGE_HASHES = [
    0,
    1,
    2**32 - 1,
    2**32,
    2**32 + 1,
    2**63 - 1,
    2**63,
    2**64 - 2**32,
    2**64 - 2**32 - 1,
    2**64 - 2,
    2**64 - 1,
    0x9E3779B97F4A7C15,
    0xFFFFFFFF00000001,
]
EDGE_COUNTS = [1, 2, 3, 4, 7, 16, 48, 64, 255, 1000, 4097, 9999, 10_000, hashing.MAX_SHARDS]


def test_range_shard_is_exactly_floor_of_h_times_n_over_2_pow_64() -> None:
    rng = np.random.default_rng(11)
    randoms = rng.integers(0, 2**64, size=2000, dtype=np.uint64).tolist()
    hashes = np.array(EDGE_HASHES + randoms, dtype=np.uint64)
    for n in [*EDGE_COUNTS, *range(1, 10_001, 97)]:
        expected = [h * n >> 64 for h in map(int, hashes)]
        assert hashing.shard_of_hashes(hashes, n).tolist() == expected, n


def test_every_shard_is_one_range_of_the_hash_space_and_its_bounds_are_exact() -> None:
    for n in EDGE_COUNTS[:-1]:
        for i in {0, 1, n // 2, n - 1}:
            if i >= n:
                continue
            first, end = hashing.shard_bounds(i, n)
            inside = np.array([first, end - 1], dtype=np.uint64)
            assert hashing.shard_of_hashes(inside, n).tolist() == [i, i]
            if first > 0:
                assert hashing.shard_of_hashes(np.array([first - 1], np.uint64), n)[0] == i - 1
            if end < 2**64:
                assert hashing.shard_of_hashes(np.array([end], np.uint64), n)[0] == i + 1
    assert hashing.shard_bounds(0, 1) == (0, 2**64)


def test_a_shard_overlaps_at_most_ceil_old_over_new_plus_one_shards_of_another_count() -> None:
    for new, old in [(48, 64), (1000, 8), (8, 1000), (3, 7), (16, 16), (5, 1), (1, 5)]:
        for i in range(new):
            first, end = hashing.shard_bounds(i, new)
            brute = [
                j
                for j in range(old)
                if max(first, hashing.shard_bounds(j, old)[0])
                < min(end, hashing.shard_bounds(j, old)[1])
            ]
            found = hashing.overlapping(i, new, old)
            assert list(found) == brute
            assert len(found) <= -(-old // new) + 1


def test_the_documented_polars_recipe_gives_the_same_shards() -> None:
    ids = pl.DataFrame({"id": [0, 1, 2, 42, 1_000_000_007, *range(100, 2000)]})
    for n in (4, 16, 1000, 10_000):
        recipe = ids.select(
            (pl.col("id").cast(pl.String).nchash.xxh3_64().cast(pl.UInt128) * n // 2**64).alias("s")
        )
        assert recipe["s"].to_list() == hashing.shard_of(ids["id"], n).tolist()


def test_shard_counts_outside_the_exact_range_are_refused() -> None:
    hashes = np.array([1], dtype=np.uint64)
    with pytest.raises(ValueError, match="between 1 and"):
        hashing.shard_of_hashes(hashes, 0)
    with pytest.raises(ValueError, match="between 1 and"):
        hashing.shard_of_hashes(hashes, 2**32)


def test_an_integer_id_hashes_as_its_decimal_text() -> None:
    as_int = hashing.xxh3(pl.DataFrame({"id": [42]}), "id")
    as_text = hashing.xxh3(pl.DataFrame({"id": ["42"]}), "id")
    as_int32 = hashing.xxh3(pl.DataFrame({"id": pl.Series([42], dtype=pl.Int32)}), "id")

    assert as_int.tolist() == as_text.tolist() == as_int32.tolist() == [1303733993043075473]


def test_row_hashes_are_pinned_including_nulls() -> None:
    df = pl.DataFrame({"id": [1, 2, 3], "subject": ["a", None, "c"], "n": [1.5, 2.0, None]})

    hashes = hashing.row_hashes(df, ["id", "subject", "n"])

    assert hashes.tolist() == [5282560569845770253, 7471470634904180772, 8397545061668888443]


def test_partition_fingerprint_is_pinned_and_ignores_order() -> None:
    df = pl.DataFrame({"id": [1, 2, 3], "subject": ["a", None, "c"], "n": [1.5, 2.0, None]})
    hashes = hashing.row_hashes(df, ["id", "subject", "n"])

    assert hashing.fingerprint(hashes) == "dd3ec7a946c45c74bbe144df5f6e1205"
    assert hashing.fingerprint(hashes[::-1].copy()) == "dd3ec7a946c45c74bbe144df5f6e1205"
    assert hashing.fingerprint(np.array([], dtype=np.uint64)) == "db27f030ad8e467c098bebb9e7c39e0a"
    assert hashing.fingerprint(hashes[:2]) != hashing.fingerprint(hashes)


def test_job_fingerprint_is_pinned_and_ignores_key_order() -> None:
    assert hashing.job_fingerprint({"b": 1, "a": [1, 2]}) == "c4ddabf5f13ea38eef439402970f7ee9"
    assert hashing.job_fingerprint({"a": [1, 2], "b": 1}) == "c4ddabf5f13ea38eef439402970f7ee9"
    assert hashing.job_fingerprint({"a": [2, 1], "b": 1}) != "c4ddabf5f13ea38eef439402970f7ee9"


def test_a_changed_value_a_swap_of_columns_and_null_against_text_change_the_row_hash() -> None:
    df = pl.DataFrame({"id": [1], "x": ["p"], "y": ["q"]})
    changed = pl.DataFrame({"id": [1], "x": ["p!"], "y": ["q"]})
    swapped = pl.DataFrame({"id": [1], "x": ["q"], "y": ["p"]})
    null_vs_text = pl.DataFrame({"id": [1], "x": [None], "y": ["q"]}, schema=df.schema)
    text_null = pl.DataFrame({"id": [1], "x": ["null"], "y": ["q"]})

    base = hashing.row_hashes(df, ["id", "x", "y"])[0]

    assert hashing.row_hashes(changed, ["id", "x", "y"])[0] != base
    assert hashing.row_hashes(swapped, ["id", "x", "y"])[0] != base
    assert (
        hashing.row_hashes(null_vs_text, ["id", "x", "y"])[0]
        != hashing.row_hashes(text_null, ["id", "x", "y"])[0]
    )
