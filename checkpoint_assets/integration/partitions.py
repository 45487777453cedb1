"""Shard partitions: a plain ``StaticPartitionsDefinition`` whose keys say ``<i>-of-<n>``.

Dagster rejects custom ``PartitionsDefinition`` subclasses and rebuilds static ones from a
snapshot in the webserver and daemon, so everything a shard needs is in its key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import dagster as dg

_KEY = re.compile(r"^(\d+)-of-(\d+)$")


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``."""

    index: int
    count: int

    @property
    def key(self) -> str:
        width = len(str(self.count))
        return f"{self.index:0{width}d}-of-{self.count}"


def shard_partitions(n: int) -> dg.StaticPartitionsDefinition:
    """Partitions that split an input into ``n`` shards by a stable hash of each row's id.

    Keys are ``"<i>-of-<n>"`` with ``i`` zero-padded to the width of ``n``. A row belongs to
    shard ``xxh3_64(str(id)) % n`` (see ``checkpoint_assets.engine.hashing``), so a row never
    moves between shards when the input is reordered, grows, shrinks, or is limited.

    >>> shard_partitions(16).get_partition_keys()[:2]
    ['00-of-16', '01-of-16']
    """
    if n < 1:
        raise ValueError(f"shard_partitions needs at least one shard, got {n}")
    return dg.StaticPartitionsDefinition([Shard(i, n).key for i in range(n)])


def parse_shard(key: str) -> Shard | None:
    """The shard a partition key names, or None for keys of other partition schemes."""
    match = _KEY.match(key)
    if not match:
        return None
    index, count = int(match[1]), int(match[2])
    if count < 1 or index >= count:
        return None
    return Shard(index, count)
