"""An ordinary output stored for its checkpointed downstream assets: in the keyed layout of
their id (``engine/sharding/keyed.py``), the rows whose ids they would refuse marked, so that a
whole-source id check reads the file's footer alone (``ids_refused``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl
import pyarrow.parquet as pq

from checkpoint_assets.engine.plan.resume import SOURCE_ROW
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.keyed import ROW_GROUP_ROWS, Resolve, write_keyed
from checkpoint_assets.engine.sharding.scheme import SHARD_KEY_PREFIX, shard_key_column
from checkpoint_assets.engine.storage import Store
from checkpoint_assets.engine.storage.arrow import arrow_filesystem
from checkpoint_assets.integration.store.source import as_lazy


def store_output(store: Store, path: str, value: Any, id_columns: Sequence[str]) -> int:
    """Write an ordinary output to ``path`` as Parquet, streamed; returns its row count.

    ``id_columns`` are what its checkpointed downstream assets shard by. Each gets its shard key
    column, and the file is in the keyed layout of the first one's (``keyed.py``). It is written
    in bounded memory whatever the size of ``value``.

    That order is not the source's. The rows whose ids they would refuse (null, or duplicated in
    the first) keep their position in ``value`` in a ``SOURCE_ROW`` column. It is null for every
    other row, so it takes no space.
    """
    frame = as_lazy(value)
    schema = frame.collect_schema()
    if SOURCE_ROW in schema:
        frame = frame.drop(SOURCE_ROW)
    keyed = [c for c in id_columns if c in schema]
    with store.put_file(path) as local:
        if not keyed:
            frame.sink_parquet(
                local, compression="zstd", statistics=True, row_group_size=ROW_GROUP_ROWS
            )
            return int(pq.read_metadata(local).num_rows)
        frame = frame.with_row_index(SOURCE_ROW).with_columns(
            hashing.shard_key(c, schema[c]).alias(shard_key_column(c)) for c in keyed
        )
        batches = frame.collect_batches()
        key, columns = shard_key_column(keyed[0]), frame.collect_schema()
        return write_keyed(batches, key, local, columns, _refused_rows_only(keyed))


def ids_refused(store: Store, path: str, id_column: str) -> int | None:
    """How many rows of the stored output at ``path`` may have a null or duplicated
    ``id_column``, from its footer alone (no data read): 0 when none has; None when the file
    does not say (stored unkeyed, or keyed by another id).

    ``store_output`` keeps ``SOURCE_ROW`` of exactly those rows when the file is keyed by that
    id first (its first shard key column): the column's null counts in the footer's statistics
    then count them, and a clean source has none.
    """
    if store.local:
        metadata = pq.read_metadata(path)
    else:
        metadata = pq.read_metadata(path, filesystem=arrow_filesystem(store))
    names = metadata.schema.names
    keys = [n for n in names if n.startswith(SHARD_KEY_PREFIX)]
    if not keys or keys[0] != shard_key_column(id_column) or SOURCE_ROW not in names:
        return None
    column = names.index(SOURCE_ROW)
    marked = 0
    for group in range(metadata.num_row_groups):
        chunk = metadata.row_group(group)
        statistics = chunk.column(column).statistics
        if statistics is None or not statistics.has_null_count:
            return None
        marked += chunk.num_rows - statistics.null_count
    return marked


def _refused_rows_only(id_columns: Sequence[str]) -> Resolve:
    """Keep ``SOURCE_ROW`` of the rows with a null id, or a duplicated first id (all rows of an
    id are in one bucket of the first id's keys)."""
    refused = pl.col(id_columns[0]).is_duplicated() | pl.any_horizontal(
        pl.col(c).is_null() for c in id_columns
    )
    return lambda rows: rows.with_columns(pl.when(refused).then(pl.col(SOURCE_ROW)))
