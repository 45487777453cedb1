"""The source of a checkpointed asset, read lazily: a shard's memory and reads follow the shard.

The chain, for an upstream stored by ``CheckpointIOManager``::

    upstream     ──> handle_output ──> store_output()   rows ordered by the shard key of the id
                     column its checkpointed assets shard by, kept in a column ``_shard_key:<id>``
                     with statistics, in row groups of ``ROW_GROUP_ROWS`` rows, written by polars'
                     streaming sink (a LazyFrame is never collected whole)
    checkpointed ──> load_input    ──> scan()           a LazyFrame over the stored file
    asset body   ──> ShardRows(as_lazy(source), ...)    ``rows_in``'s filter, collected by the
                     streaming engine; the reader skips row groups whose keys miss the shard

Any other source (a LazyFrame an upstream returns, a DataFrame, another IO manager's table) is
filtered the same way, the shard key computed from the id column as the rows stream past.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from checkpoint_assets.engine import hashing
from checkpoint_assets.engine.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.rows import BOOKKEEPING, CURRENT, ERROR, SEQ
from checkpoint_assets.engine.scheme import SHARD_KEY_PREFIX, Frame, rows_in, shard_key_column
from checkpoint_assets.engine.storage import Store

# 16,384 rows a row group: a shard of 1/16 of 8M rows reads at most 2 row groups it does not need
# (one at each end of its key range), 0.4 % more than its own.
ROW_GROUP_ROWS = 1 << 14
# Files written with page checksums (checkpoints' merged files) are checked as they are read.
_PARQUET = ds.ParquetFileFormat(
    default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True)
)


def as_lazy(value: Any) -> pl.LazyFrame:
    """The source asset's value as a polars LazyFrame (polars, pyarrow or pandas)."""
    if isinstance(value, pl.LazyFrame):
        return value
    if isinstance(value, pl.DataFrame):
        return value.lazy()
    if isinstance(value, pa.Table):
        frame = pl.from_arrow(value)
        assert isinstance(frame, pl.DataFrame)
        return frame.lazy()
    if type(value).__module__.startswith("pandas"):
        return pl.from_pandas(value).lazy()
    raise CheckpointError(
        f"The source of a checkpointed asset must be a polars, pyarrow or pandas table; got "
        f"{type(value).__name__}.",
        "Return a table from the source asset.",
    )


def user_columns(names: Sequence[str]) -> list[str]:
    """``names`` without the stored shard key columns."""
    return [c for c in names if not c.startswith(SHARD_KEY_PREFIX)]


def without_shard_keys(frame: Frame) -> Frame:
    """``frame`` (a DataFrame or LazyFrame) as the upstream returned it: no shard key column."""
    names = frame.collect_schema().names()
    kept = user_columns(names)
    return frame if len(kept) == len(names) else frame.select(kept)


class ShardRows:
    """The input rows of each shard of one run, collected once for all of them (a ranged run)
    by the streaming engine, so no more than the run's shards are ever in memory.

    The filter is applied to the source as it is, so polars pushes it down to the scan: the
    source's own computed columns are computed for these rows only.
    """

    def __init__(self, source: pl.LazyFrame, id_column: str, keys: Sequence[str | None]) -> None:
        self.id_column = id_column
        rows = rows_in(source, id_column, keys).collect(engine="streaming")
        self.columns = user_columns(rows.columns)
        self.several = len(keys) > 1
        column = shard_key_column(id_column)
        if self.several and id_column in rows.columns and column not in rows.columns:
            # Hashed once here, so each shard of a ranged run compares integers.
            key = hashing.shard_key(id_column, rows.schema[id_column])
            rows = rows.with_columns(key.alias(column))
        self.rows = rows

    def of(self, key: str | None) -> pl.DataFrame:
        """The input rows of shard ``key`` (or of a partition key that takes them all)."""
        rows = rows_in(self.rows, self.id_column, [key]) if self.several else self.rows
        return rows.select(self.columns)


def store_output(store: Store, path: str, value: Any, id_columns: Sequence[str]) -> int:
    """Write an ordinary output to ``path`` as Parquet; returns its row count.

    With ``id_columns`` (what its checkpointed downstream assets shard by), each gets its shard
    key column and the rows are ordered by the first one's.
    """
    frame = as_lazy(value)
    schema = frame.collect_schema()
    keyed = [c for c in id_columns if c in schema]
    if keyed:
        frame = frame.with_columns(
            hashing.shard_key(c, schema[c]).alias(shard_key_column(c)) for c in keyed
        ).sort(shard_key_column(keyed[0]))
    with store.put_file(path) as local:
        frame.sink_parquet(
            local, compression="zstd", statistics=True, row_group_size=ROW_GROUP_ROWS
        )
        rows = pq.read_metadata(local).num_rows
    return int(rows)


def scan(store: Store, path: str, *, checked: bool = False) -> pl.LazyFrame:
    """A lazy scan of the Parquet file at ``path``: filters on columns with statistics skip row
    groups, and only the row groups and columns a query needs are read.

    On local disk, polars' own reader (parallel, strings decoded straight into polars' layout);
    on any other filesystem (S3...), pyarrow's through the store's fsspec filesystem, which
    reads byte ranges. ``checked``: read through pyarrow wherever the file is, every page's
    checksum checked (checkpoints' merged files carry them).
    """
    if store.local and not checked:
        return pl.scan_parquet(path)
    filesystem = pafs.PyFileSystem(pafs.FSSpecHandler(store.fs))
    return pl.scan_pyarrow_dataset(ds.dataset(path, filesystem=filesystem, format=_PARQUET))


def scan_result(
    checkpoint: Checkpoint, id_column: str, outputs: Sequence[str], base_seq: int
) -> pl.LazyFrame | None:
    """What ``Checkpoint.read_result`` returns, as a lazy scan of the merged file, pages checked.

    None when the checkpoint holds parts not merged yet (its run stopped before finalizing, or
    is running): resolving them takes ``read_result``, which reads them whole.
    """
    live, redundant = checkpoint.list_parts()
    if live or redundant or not checkpoint.store.fs.exists(checkpoint.files.merged):
        return None
    frame = scan(checkpoint.store, checkpoint.files.merged, checked=True)
    names = frame.collect_schema().names()
    if base_seq > 0:
        frame = frame.filter(pl.col(SEQ) >= base_seq)  # rows of earlier generations are not done
    if CURRENT in names:
        frame = frame.filter(pl.col(CURRENT).fill_null(True))
    shown = outputs or [c for c in names if c != id_column and c not in BOOKKEEPING]
    return frame.select([c for c in [id_column, *shown, ERROR] if c in names])
