"""Stable hashes: the same bytes give the same values everywhere, forever.

The values below were computed once and are pinned: a change here moves rows between shards
and invalidates every stored checkpoint, so it must be a deliberate, documented format change.
Input hash format 2 changed only the text of nested values holding a NaN, an infinity or a null
float; the format-1 values of everything else are pinned as format 2's too.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_assets.engine.checkpoints.meta import Meta
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.scheme import rows_in


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


@pytest.mark.parametrize("count", [1, 2, 3, 7, 16, 1000, hashing.MAX_SHARDS])
@pytest.mark.parametrize(
    "ids",
    [
        pl.Series("id", [0, 1, 2, 42, 1_000_000_007, -5, None, *range(100, 400)]),
        pl.Series("id", ["a", "ticket-9", "", None, *(f"t{i}" for i in range(300))]),
    ],
)
def test_the_lazy_shard_filter_selects_exactly_the_rows_shard_of_assigns(
    count: int, ids: pl.Series
) -> None:
    frame = ids.to_frame()
    expected = hashing.shard_of(ids, count)
    indexes = sorted({*sorted(set(expected.tolist()))[:3], count - 1})  # the last: no end

    for index in indexes:
        key = f"{index}-of-{count}"
        lazy = rows_in(frame.lazy(), "id", [key]).collect(engine="streaming")
        assert lazy.get_column("id").to_list() == ids.filter(expected == index).to_list()
    keys = [f"{i}-of-{count}" for i in indexes]
    both = rows_in(frame.lazy(), "id", keys).collect(engine="streaming")
    assert both.get_column("id").to_list() == ids.filter(np.isin(expected, indexes)).to_list()


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


def test_content_keys_are_pinned_and_leave_the_id_out() -> None:
    df = pl.DataFrame({"id": [1, 2, 3], "subject": ["a", None, "c"], "n": [1.5, 2.0, None]})
    renumbered = df.with_columns(pl.col("id") + 1000)

    hi, lo = hashing.content_keys(df, ["subject", "n"])

    assert hi.tolist() == CONTENT_HI and lo.tolist() == CONTENT_LO
    again = hashing.content_keys(renumbered, ["subject", "n"])
    assert again[0].tolist() == CONTENT_HI and again[1].tolist() == CONTENT_LO
    # the high half is the fold of the input hash without the id: the dedupe key
    assert hi.tolist() == hashing.row_hashes(df, ["subject", "n"]).tolist()
    swapped = hashing.content_keys(df, ["n", "subject"])
    assert swapped[0].tolist() != CONTENT_HI  # the columns' order counts, as in the input hash


CONTENT_HI = [18384413743486236949, 1504303429523165072, 12850314541150449627]
CONTENT_LO = [1214569809266374806, 3308574961465784744, 4402523471381928493]


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


# -- nested values: NaN, infinities and null -------------------------------------------------
NAN, INF = float("nan"), float("inf")
# Nested values without a NaN, an infinity or a null float: format 2 keeps their format-1 text
# and hash. The expected values are what the format-1 code computes. So checkpoints whose nested
# inputs hold none of these values resume unchanged.
UNCHANGED_BY_FORMAT_2 = [
    (
        pl.List(pl.Float64),
        [1.5, -0.0, 1e308, 2.0],
        '{"v":[1.5,-0.0,1e+308,2.0]}',
        6390909059473706324,
    ),
    (pl.List(pl.Float64), [], '{"v":[]}', 11495886103672785079),
    (pl.List(pl.Float32), [1.5, 0.1], '{"v":[1.5,0.1]}', 2823572677017765130),
    (pl.Array(pl.Float64, 2), [1.5, 2.25], '{"v":[1.5,2.25]}', 9904439386385938381),
    (
        pl.Struct({"a": pl.Float64, "b": pl.String}),
        {"a": 1.5, "b": "x"},
        '{"v":{"a":1.5,"b":"x"}}',
        11413986721433114118,
    ),
    (
        pl.List(pl.Struct({"a": pl.Float64, "b": pl.List(pl.Float64)})),
        [{"a": 1.5, "b": [2.5]}],
        '{"v":[{"a":1.5,"b":[2.5]}]}',
        8515804310681438467,
    ),
    (pl.List(pl.Binary), [b"\x00", None], '{"v":["00",null]}', 3666449607366903982),
]


def _xxh3(dtype: pl.DataType, value: Any, hash_format: int = hashing.HASH_FORMAT) -> int:
    df = pl.DataFrame({"v": pl.Series([value], dtype=dtype)})
    return int(df.select(hashing._text_hash("v", dtype, hash_format)).item())


@pytest.mark.parametrize("hash_format", [1, 2])
@pytest.mark.parametrize(
    "dtype, value, text, pinned",
    UNCHANGED_BY_FORMAT_2,
    ids=[str(c[0]) for c in UNCHANGED_BY_FORMAT_2],
)
def test_nested_values_without_nan_infinity_or_null_floats_keep_their_format_1_text(
    hash_format: int, dtype: pl.DataType, value: Any, text: str, pinned: int
) -> None:
    df = pl.DataFrame({"v": pl.Series([value], dtype=dtype)})

    assert df.select(hashing.value_text("v", dtype, hash_format=hash_format)).item() == text
    assert _xxh3(dtype, value, hash_format) == pinned


# Format 1 wrote all four as JSON's null; format 2 writes the floats of such a value as text.
NON_FINITE_PINNED = [
    ([NAN], '{"floats_as_text":["NaN"]}', 8546332465733912057),
    ([None], '{"floats_as_text":[null]}', 8194460745104624994),
    ([INF], '{"floats_as_text":["inf"]}', 4138861045856732673),
    ([-INF], '{"floats_as_text":["-inf"]}', 1351094315571038013),
    ([1.5, NAN], '{"floats_as_text":["1.5","NaN"]}', None),
]
FORMAT_1_NULL_LIST = 5457870857245523162  # '{"v":[null]}', what format 1 gave all four


def test_nan_infinities_and_null_inside_a_list_have_distinct_pinned_texts() -> None:
    dtype = pl.List(pl.Float64)
    for value, text, pinned in NON_FINITE_PINNED:
        df = pl.DataFrame({"v": pl.Series([value], dtype=dtype)})
        assert df.select(hashing.value_text("v", dtype)).item() == text
        if pinned is not None:
            assert _xxh3(dtype, value) == pinned
    for value, _, _ in NON_FINITE_PINNED[:4]:
        assert _xxh3(dtype, value, hash_format=1) == FORMAT_1_NULL_LIST


def test_the_exact_float_text_reaches_every_depth_and_keeps_binary_as_hex() -> None:
    dtype = pl.List(pl.Struct({"a": pl.Float32, "b": pl.Binary, "c": pl.Array(pl.Float64, 1)}))
    value = [{"a": NAN, "b": b"\x02", "c": [-INF]}, None, {"a": 1.0, "b": None, "c": None}]
    df = pl.DataFrame({"v": pl.Series([value], dtype=dtype)})

    text = df.select(hashing.value_text("v", dtype)).item()

    assert text == (
        '{"floats_as_text":[{"a":"NaN","b":"02","c":["-inf"]},null,{"a":"1.0","b":null,"c":null}]}'
    )


def test_a_meta_without_an_input_hash_format_was_written_by_format_1() -> None:
    meta = Meta(job_fingerprint="f", job={}, id_column="id", id_dtype="Int64")
    assert meta.input_hash_format == hashing.HASH_FORMAT == 2
    assert Meta.from_json(meta.to_json(), "here").input_hash_format == 2
    earlier = json.loads(meta.to_json())
    del earlier["input_hash_format"]

    assert Meta.from_json(json.dumps(earlier).encode(), "here").input_hash_format == 1


# Property: nested values of several shapes whose float leaves are NaN, inf, -inf, null or finite.
SPECIAL = [NAN, INF, -INF, None]
F64 = st.one_of(st.sampled_from(SPECIAL), st.floats(allow_nan=False, allow_infinity=False))
F32 = st.one_of(
    st.sampled_from(SPECIAL), st.floats(allow_nan=False, allow_infinity=False, width=32)
)


def _maybe_null(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), inner)


SHAPES: list[tuple[pl.DataType, st.SearchStrategy[Any]]] = [
    (pl.List(pl.Float64), st.lists(F64, max_size=4)),
    (pl.List(pl.Float32), st.lists(F32, max_size=4)),
    (pl.Array(pl.Float64, 2), st.lists(F64, min_size=2, max_size=2)),
    (pl.List(pl.List(pl.Float64)), st.lists(_maybe_null(st.lists(F64, max_size=3)), max_size=3)),
    (
        pl.Struct({"a": pl.Float64, "b": pl.List(pl.Float32), "s": pl.String}),
        st.fixed_dictionaries(
            {"a": F64, "b": _maybe_null(st.lists(F32, max_size=3)), "s": st.text(max_size=2)}
        ),
    ),
    (
        pl.List(pl.Struct({"a": pl.Float64, "c": pl.Array(pl.Float64, 2)})),
        st.lists(
            _maybe_null(
                st.fixed_dictionaries(
                    {"a": F64, "c": _maybe_null(st.lists(F64, min_size=2, max_size=2))}
                )
            ),
            max_size=3,
        ),
    ),
    (
        pl.Struct({"x": pl.Struct({"y": pl.List(pl.List(pl.Float64))}), "n": pl.Int64}),
        st.fixed_dictionaries(
            {
                "x": _maybe_null(
                    st.fixed_dictionaries(
                        {"y": _maybe_null(st.lists(st.lists(F64, max_size=2), max_size=2))}
                    )
                ),
                "n": st.integers(-5, 5),
            }
        ),
    ),
]


@st.composite
def nested_values(draw: st.DrawFn) -> tuple[pl.DataType, Any]:
    dtype, values = draw(st.sampled_from(SHAPES))
    return dtype, draw(values)


def _float_leaves(
    value: Any, dtype: pl.DataType, path: tuple[Any, ...] = ()
) -> Iterator[tuple[Any, ...]]:
    """The paths of the float values (null ones too) inside ``value`` of type ``dtype``."""
    if dtype.is_float():
        yield path
    elif value is None:
        return
    elif isinstance(dtype, pl.List | pl.Array):
        for i, item in enumerate(value):
            yield from _float_leaves(item, dtype.inner, (*path, i))  # type: ignore[arg-type]
    elif isinstance(dtype, pl.Struct):
        for f in dtype.fields:
            yield from _float_leaves(value[f.name], f.dtype, (*path, f.name))  # type: ignore[arg-type]


def _replaced(value: Any, path: tuple[Any, ...], leaf: Any) -> Any:
    if not path:
        return leaf
    head, rest = path[0], path[1:]
    if isinstance(value, list):
        return [_replaced(v, rest, leaf) if i == head else v for i, v in enumerate(value)]
    return {k: _replaced(v, rest, leaf) if k == head else v for k, v in value.items()}


def _leaf_at(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


def _kind(leaf: float | None) -> str:
    if leaf is None:
        return "null"
    if math.isnan(leaf):
        return "nan"
    return repr(leaf)  # "inf", "-inf", or the finite value itself ("-0.0" apart from "0.0")


def _unclear(value: Any, dtype: pl.DataType) -> bool:
    kinds = {_kind(_leaf_at(value, p)) for p in _float_leaves(value, dtype)}
    return bool(kinds & {"null", "nan", "inf", "-inf"})


def _row_hash(dtype: pl.DataType, values: list[Any], hash_format: int = 2) -> list[int]:
    df = pl.DataFrame({"id": [0] * len(values), "v": pl.Series(values, dtype=dtype)})
    return hashing.row_hashes(df, ["id", "v"], hash_format=hash_format).tolist()


PROPERTY = settings(max_examples=100, deadline=None, derandomize=True)


@PROPERTY
@given(case=nested_values(), data=st.data())
def test_equal_nested_values_hash_equal_and_one_changed_float_leaf_changes_the_hash(
    case: tuple[pl.DataType, Any], data: st.DataObject
) -> None:
    dtype, value = case
    leaves = list(_float_leaves(value, dtype))
    # Equal values, built separately, alone or among other rows: equal hashes.
    same = _row_hash(dtype, [value, None, copy.deepcopy(value)])
    assert same[0] == same[2] == _row_hash(dtype, [copy.deepcopy(value)])[0]
    if not leaves:
        return
    path = data.draw(st.sampled_from(leaves))
    old = _leaf_at(value, path)
    new = data.draw(
        st.sampled_from([NAN, INF, -INF, None, 2.5]).filter(lambda x: _kind(x) != _kind(old))
    )
    changed = _replaced(value, path, new)

    assert _row_hash(dtype, [changed])[0] != same[0], (old, new)


@PROPERTY
@given(case=nested_values())
def test_format_2_changes_the_hash_of_exactly_the_values_holding_unclear_floats(
    case: tuple[pl.DataType, Any],
) -> None:
    dtype, value = case

    format_1, format_2 = _row_hash(dtype, [value], 1), _row_hash(dtype, [value], 2)

    assert (format_1 != format_2) == _unclear(value, dtype)
