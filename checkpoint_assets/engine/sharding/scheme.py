"""Partition schemes: which input rows a checkpoint holds, recorded in its meta.

A checkpoint belongs to one of three schemes:

- a **shard** ``i`` of ``n``, with partition key ``"<i>-of-<n>"`` (``i`` zero-padded to the
  width of ``n``). It holds the input rows whose id hashes to shard ``i`` by the *range rule*
  (``shard_of`` in ``hashing.py``), recorded as ``"rule": "range"``. A shard recorded without a
  rule was written by the *mod rule* (``h % n``), where the same key holds other rows. So a run
  never resumes such a checkpoint as if it were a range shard (see ``rule_changed``);
- another **partition** key: the whole input the asset receives for that partition;
- **unpartitioned**: the whole input.

``rows_in`` is the one implementation of "which input rows belong to these shards", used by a
run and by the completeness check alike.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import polars as pl

from checkpoint_assets.engine.sharding import hashing

Rule = Literal["range", "mod"]
RANGE: Rule = "range"
# Checkpoints written before range sharding record no rule: they hold shards by ``h % n``.
LEGACY_RULE: Rule = "mod"
_KEY = re.compile(r"^(\d+)-of-(\d+)$")
SHARD_KEY_PREFIX = "_shard_key:"
Frame = TypeVar("Frame", pl.DataFrame, pl.LazyFrame)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``, by ``rule`` (partition keys always name range shards)."""

    index: int
    count: int
    rule: Rule = RANGE

    @property
    def key(self) -> str:
        """The partition key: ``"03-of-16"``."""
        width = len(str(self.count))
        return f"{self.index:0{width}d}-of-{self.count}"

    @classmethod
    def parse(cls, key: str) -> Shard | None:
        """The shard a partition key names, or None for keys of other partition schemes."""
        match = _KEY.match(key)
        if not match:
            return None
        index, count = int(match[1]), int(match[2])
        if count < 1 or index >= count or count > hashing.MAX_SHARDS:
            return None
        return cls(index, count)


@dataclass(frozen=True)
class Scheme:
    """The partition scheme of one checkpoint, as recorded in its meta."""

    kind: Literal["shard", "partition", "unpartitioned"]
    shard: Shard | None = None
    key: str | None = None

    @classmethod
    def of(cls, partition: str | None) -> Scheme:
        """The scheme of a checkpoint of ``partition`` (None: unpartitioned)."""
        if partition is None:
            return cls("unpartitioned")
        shard = Shard.parse(partition)
        if shard is not None:
            return cls("shard", shard=shard, key=partition)
        return cls("partition", key=partition)

    @property
    def label(self) -> str:
        if self.shard is not None:
            rule = "" if self.shard.rule == RANGE else f" ({self.shard.rule} rule)"
            return f"{self.shard.count} shards{rule}"
        if self.kind == "unpartitioned":
            return "unpartitioned"
        return f"partition {self.key}"

    def to_json(self) -> dict[str, Any]:
        if self.shard is not None:
            shard = self.shard
            return {"kind": "shard", "index": shard.index, "count": shard.count, "rule": shard.rule}
        if self.kind == "partition":
            return {"kind": "partition", "key": self.key}
        return {"kind": "unpartitioned"}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Scheme | None:
        if not data:
            return None
        kind = data.get("kind")
        if kind == "shard":
            rule = data.get("rule", LEGACY_RULE)
            if rule not in (RANGE, LEGACY_RULE):
                raise ValueError(f"unknown shard rule {rule!r}")
            shard = Shard(int(data["index"]), int(data["count"]), rule)
            return cls("shard", shard=shard, key=shard.key)
        if kind == "partition":
            return cls("partition", key=str(data.get("key")))
        return cls("unpartitioned")  # older checkpoints record it as "all"


def rule_changed(stored: Scheme | None, current: Scheme | None) -> bool:
    """Did the checkpoint of a shard key hold its rows by another rule than the current one?"""
    old = stored.shard if stored else None
    new = current.shard if current else None
    return old is not None and new is not None and old.rule != new.rule


def shard_key_column(id_column: str) -> str:
    """The column of a stored source that holds the shard key of ``id_column``.

    The source's rows are stored ordered by it, so a shard's filter skips the row groups of
    other shards.
    """
    return f"{SHARD_KEY_PREFIX}{id_column}"


def shard_filter(shards: Sequence[Shard], key: pl.Expr) -> pl.Expr:
    """True for the rows whose shard key (``hashing.shard_key``) falls in any of ``shards``."""
    ranges = []
    for shard in shards:
        first, end = hashing.shard_key_bounds(shard.index, shard.count)
        inside = key >= first
        ranges.append(inside if end is None else inside & (key < end))
    # Plain comparisons joined by ``|``: Parquet readers push them down to row group statistics.
    return functools.reduce(operator.or_, ranges)


def rows_in(frame: Frame, id_column: str, partitions: Sequence[str | None]) -> Frame:
    """The rows of ``frame`` that the checkpoints of ``partitions`` process.

    Shard keys select their rows by id; any other key (or none) takes the whole input. A lazy
    ``frame`` stays lazy: the filter is a polars expression. So a streaming collect holds only
    the shard's rows. A stored shard key column (``shard_key_column``) lets the Parquet reader
    skip the row groups of other shards.
    """
    shards = [Shard.parse(p) if p is not None else None for p in partitions]
    schema = frame.collect_schema()
    if not shards or any(s is None for s in shards) or id_column not in schema:
        return frame  # missing ids fail later, with a clear error
    stored = shard_key_column(id_column)
    key = pl.col(stored) if stored in schema else hashing.shard_key(id_column, schema[id_column])
    return frame.filter(shard_filter([s for s in shards if s is not None], key))
