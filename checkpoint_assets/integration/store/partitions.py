"""Shard partitions: a plain ``StaticPartitionsDefinition`` whose keys say ``<i>-of-<n>``.

Dagster rejects custom ``PartitionsDefinition`` subclasses. It rebuilds static ones from a
snapshot in the webserver and daemon. So everything a shard needs is in its key (see
``checkpoint_assets.engine.sharding.scheme``).
"""

from __future__ import annotations

import dagster as dg

from checkpoint_assets.engine.sharding.hashing import MAX_SHARDS
from checkpoint_assets.engine.sharding.scheme import Shard


def shard_partitions(n: int) -> dg.StaticPartitionsDefinition:
    """Partitions that split an input into ``n`` shards by a stable hash of each row's id.

    Keys are ``"<i>-of-<n>"`` with ``i`` zero-padded to the width of ``n``. A row belongs to
    shard ``floor(xxh3_64(str(id)) * n / 2**64)``
    (see ``checkpoint_assets.engine.sharding.hashing``). Each shard is one contiguous range of
    the hash space. A row never moves between shards when the input is reordered, grows,
    shrinks, or is limited.

    Examples:
        >>> shard_partitions(16).get_partition_keys()[:2]
        ['00-of-16', '01-of-16']
    """
    if not 1 <= n <= MAX_SHARDS:
        raise ValueError(f"shard_partitions needs between 1 and {MAX_SHARDS} shards, got {n}")
    return dg.StaticPartitionsDefinition([Shard(i, n).key for i in range(n)])
