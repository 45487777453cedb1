"""Partition schemes: which input rows a checkpoint holds, recorded in its meta.

A checkpoint belongs to one of three schemes:

- a **shard** ``i`` of ``n`` (partition key ``"<i>-of-<n>"``, ``i`` zero-padded to the width of
  ``n``): the input rows whose id hashes to shard ``i`` (``shard_of`` in ``hashing.py``) by the
  *range rule*, recorded as ``"rule": "range"``. A shard recorded without a rule was written by
  the *mod rule* of earlier versions (``h % n``): the same key then held other rows, so a run
  never resumes such a checkpoint as if it were a range shard (see ``rule_changed``);
- another **partition** key: the whole input the asset receives for that partition;
- **unpartitioned**: the whole input.

``rows_in`` is the one implementation of "which input rows belong to these shards", used by a
run and by the completeness check alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import polars as pl

from checkpoint_assets.engine import hashing

Rule = Literal["range", "mod"]
RANGE: Rule = "range"
# Checkpoints written before range sharding record no rule: they hold shards by ``h % n``.
LEGACY_RULE: Rule = "mod"
_KEY = re.compile(r"^(\d+)-of-(\d+)$")


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
        return cls("unpartitioned")  # "all" in checkpoints written before this name


def rule_changed(stored: Scheme | None, current: Scheme | None) -> bool:
    """Did the checkpoint of a shard key hold its rows by another rule than the current one?"""
    old = stored.shard if stored else None
    new = current.shard if current else None
    return old is not None and new is not None and old.rule != new.rule


class ShardIndex:
    """The shard of each row of one input, hashed once per shard count."""

    def __init__(self, ids: pl.Series) -> None:
        self.ids = ids
        self._of: tuple[int, np.ndarray] | None = None

    def mask(self, shards: Sequence[Shard]) -> np.ndarray:
        """True for the rows of any of ``shards``."""
        out = np.zeros(len(self.ids), dtype=bool)
        for count in sorted({s.count for s in shards}):
            if self._of is None or self._of[0] != count:
                self._of = (count, hashing.shard_of(self.ids, count))
            out |= np.isin(self._of[1], [s.index for s in shards if s.count == count])
        return out


def rows_in(
    frame: pl.DataFrame,
    id_column: str,
    partitions: Sequence[str | None],
    index: ShardIndex | None = None,
) -> pl.DataFrame:
    """The rows of ``frame`` that the checkpoints of ``partitions`` process.

    Shard keys select their rows by id; any other key (or none) takes the whole input.
    ``index``: the input's shard index, to hash ids once across several calls.
    """
    shards = [Shard.parse(p) if p is not None else None for p in partitions]
    if not shards or any(s is None for s in shards) or id_column not in frame.columns:
        return frame  # missing ids fail later, with a clear error
    index = index or ShardIndex(frame.get_column(id_column))
    return frame.filter(pl.Series(index.mask([s for s in shards if s is not None])))
