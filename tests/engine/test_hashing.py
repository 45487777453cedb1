"""Stable hashes: the same bytes give the same values everywhere, forever.

The values below were computed once and are pinned: a change here moves rows between shards
and invalidates every stored checkpoint, so it must be a deliberate, documented format change.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from checkpoint_assets.engine import hashing


def test_shard_of_integer_ids_is_pinned() -> None:
    ids = pl.Series("id", [0, 1, 2, 42, 1_000_000_007])

    assert hashing.shard_of(ids, 16).tolist() == [5, 8, 4, 1, 14]
    assert hashing.shard_of(ids, 4).tolist() == [1, 0, 0, 1, 2]


def test_shard_of_string_ids_is_pinned() -> None:
    ids = pl.Series("id", ["a", "ticket-1", "ünïcode", ""])

    assert hashing.shard_of(ids, 16).tolist() == [15, 3, 7, 2]


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
