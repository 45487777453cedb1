"""The source of a checkpointed asset, read lazily: a shard's memory and reads follow the shard.

The chain, for an upstream stored by ``CheckpointIOManager``::

    upstream     ──> handle_output ──> store_output()   rows ordered by the shard key of the id
                     column its checkpointed assets shard by, kept in a column ``_shard_key:<id>``
                     with statistics, in row groups of ``ROW_GROUP_ROWS`` rows: the keyed layout,
                     written in bounded memory (``keyed.py``; a LazyFrame is never collected whole)
    checkpointed ──> load_input    ──> scan()           a LazyFrame over the stored file
    asset body   ──> ShardRows(as_lazy(source), ...)    ``rows_in``'s filter, collected by the
                     streaming engine; the reader skips row groups whose keys miss the shard

Any other source (a LazyFrame an upstream returns, a DataFrame, another IO manager's table) is
filtered the same way, the shard key computed from the id column as the rows stream past. A
partitioned source (``source_partition_mapping``) is one scan per partition, concatenated: the
filter reaches each, so a shard reads its slice of every partition.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.plan.resume import SOURCE_ROW
from checkpoint_assets.engine.rows import BOOKKEEPING, CURRENT, ERROR, SEQ, distinct_count
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.keyed import ROW_GROUP_ROWS, Buckets, Resolve, write_keyed
from checkpoint_assets.engine.sharding.scheme import (
    SHARD_KEY_PREFIX,
    Frame,
    Shard,
    rows_in,
    shard_filter,
    shard_key_column,
)
from checkpoint_assets.engine.storage import Store
from checkpoint_assets.engine.storage.arrow import arrow_filesystem

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
    """``names`` without the stored shard key columns and source rows."""
    return [c for c in names if not c.startswith(SHARD_KEY_PREFIX) and c != SOURCE_ROW]


def without_shard_keys(frame: Frame) -> Frame:
    """``frame`` (a DataFrame or LazyFrame) as the upstream returned it: no shard key column."""
    names = frame.collect_schema().names()
    kept = user_columns(names)
    return frame if len(kept) == len(names) else frame.select(kept)


class ShardRows:
    """The input rows of each shard of one run, read once for all of them (a ranged run), with
    no more than one shard's rows in memory at a time. Where their ids will be refused (null or
    duplicated), each row carries its row in the source (``SOURCE_ROW``): stored with a stored
    source, else found by reading the source's id column once more, on that error path only.

    The filter is applied to the source as it is, so polars pushes it down to the scan: the
    source's own computed columns are computed for these rows only. A stored source (ordered by
    the shard key) is scanned once per shard, each reading its own row groups; any other source
    of several shards streams once into one local file per shard, read back as each shard runs.
    Use as a context manager: the local files are removed at its end.
    """

    def __init__(self, source: pl.LazyFrame, id_column: str, keys: Sequence[str | None]) -> None:
        schema = source.collect_schema()
        self.numbered = SOURCE_ROW in schema  # stored with the source
        if not self.numbered and any(c.startswith(SHARD_KEY_PREFIX) for c in schema):
            # Stored ordered by shard key without its rows: their places are not known.
            source = source.with_columns(pl.lit(None, pl.UInt32).alias(SOURCE_ROW))
            self.numbered = True
        self.source = source
        self.id_column = id_column
        self.columns = [*user_columns(schema.names()), *([SOURCE_ROW] if self.numbered else [])]
        self.shards = [Shard.parse(k) if k is not None else None for k in keys]
        self.held: pl.DataFrame | None = None  # rows of every key, filtered as each is asked
        self.spill: Buckets | None = None
        if any(s is None for s in self.shards) or id_column not in schema:
            self.held = self.source.collect(engine="streaming")  # every key takes it all
        elif len(keys) > 1 and shard_key_column(id_column) not in schema:
            self._spill(keys, hashing.shard_key(id_column, schema[id_column]))

    def _spill(self, keys: Sequence[str | None], key: pl.Expr) -> None:
        """Stream the run's rows once into one local file per shard (by position in ``keys``);
        rows that fit in the buffer stay in memory."""
        position = pl.lit(None, pl.Int64)
        for index, shard in enumerate(self.shards):
            assert shard is not None
            position = pl.when(shard_filter([shard], key)).then(index).otherwise(position)
        self.spill = Buckets(position)
        for batch in rows_in(self.source, self.id_column, keys).collect_batches():
            self.spill.add(batch)
        self.held = self.spill.in_memory()

    def __enter__(self) -> ShardRows:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.spill is not None:
            self.spill.__exit__(*exc)

    def of(self, key: str | None) -> pl.DataFrame:
        """The input rows of shard ``key`` (or of a partition key that takes them all)."""
        if self.held is not None:
            rows = rows_in(self.held, self.id_column, [key])
        elif self.spill is not None:
            index = [s.key if s else None for s in self.shards].index(key)
            taken = self.spill.take(index)
            rows = taken if taken is not None else self.source.clear().collect()
        else:
            rows = rows_in(self.source, self.id_column, [key]).collect(engine="streaming")
        rows = rows.select(self.columns)
        return rows if self.numbered else self._numbered(rows)

    def _numbered(self, rows: pl.DataFrame) -> pl.DataFrame:
        """``rows`` with the source row of each whose id is null or duplicated, found by
        numbering the source's ids; unchanged (at the cost of counting its ids) when none is.

        A shard holds every row of an id, and of null ids (shard 0), in the source's order: its
        n-th row of an id is the source's n-th."""
        ids = rows.get_column(self.id_column) if self.id_column in rows.columns else None
        if ids is None or (not ids.null_count() and distinct_count(ids) == ids.len()):
            return rows
        column = pl.col(self.id_column)
        refused = ids.filter(ids.is_duplicated()).drop_nulls().unique().implode()
        nth = pl.int_range(pl.len()).over(self.id_column).alias("__nth")
        found = (
            self.source.select(self.id_column)
            .with_row_index(SOURCE_ROW)
            .filter(column.is_null() | column.is_in(refused))
            .with_columns(nth)
            .collect(engine="streaming")
        )
        return (
            rows.with_columns(nth)
            .join(
                found,
                on=[self.id_column, "__nth"],
                how="left",
                nulls_equal=True,
                maintain_order="left",
            )
            .drop("__nth")
        )


def store_output(store: Store, path: str, value: Any, id_columns: Sequence[str]) -> int:
    """Write an ordinary output to ``path`` as Parquet, streamed; returns its row count.

    With ``id_columns`` (what its checkpointed downstream assets shard by), each gets its shard
    key column and the file is in the keyed layout of the first one's (``keyed.py``), written
    in bounded memory whatever the size of ``value``. That order is not the source's: the rows
    whose ids they would refuse (null, or duplicated in the first) keep their position in
    ``value`` in a ``SOURCE_ROW`` column (null for every other row: it takes no space).
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


def _refused_rows_only(id_columns: Sequence[str]) -> Resolve:
    """Keep ``SOURCE_ROW`` of the rows with a null id, or a duplicated first id (all rows of an
    id are in one bucket of the first id's keys)."""
    refused = pl.col(id_columns[0]).is_duplicated() | pl.any_horizontal(
        pl.col(c).is_null() for c in id_columns
    )
    return lambda rows: rows.with_columns(pl.when(refused).then(pl.col(SOURCE_ROW)))


def scan(store: Store, path: str, *, checked: bool = False) -> pl.LazyFrame:
    """A lazy scan of the Parquet file at ``path``: filters on columns with statistics skip row
    groups, and only the row groups and columns a query needs are read.

    On local disk, polars' own reader (parallel, strings decoded straight into polars' layout);
    on any other filesystem (S3...), pyarrow's, each byte range it needs one GET counted in the
    store's requests (``storage/arrow.py``). ``checked``: read through pyarrow wherever the file
    is, every page's checksum checked (checkpoints' merged files carry them).
    """
    if store.local and not checked:
        return pl.scan_parquet(path)
    filesystem = arrow_filesystem(store)
    # The footer read once: kept by the fragment, the scan reuses it instead of reading it again.
    fragment = _PARQUET.make_fragment(path, filesystem)
    fragment.ensure_complete_metadata()
    dataset = ds.FileSystemDataset([fragment], fragment.physical_schema, _PARQUET, filesystem)
    return pl.scan_pyarrow_dataset(dataset)


def scan_result(
    checkpoint: Checkpoint, id_column: str, outputs: Sequence[str], base_seq: int
) -> pl.LazyFrame | None:
    """What ``Checkpoint.read_result`` returns, as a lazy scan of the merged file, pages checked.

    None when the checkpoint holds parts not merged yet (its run stopped before finalizing, or
    is running): resolving them takes ``read_result``, which reads them whole.
    """
    live, redundant = checkpoint.list_parts()
    if live or redundant or not checkpoint.store.exists(checkpoint.files.merged):
        return None
    frame = scan(checkpoint.store, checkpoint.files.merged, checked=True)
    names = frame.collect_schema().names()
    if base_seq > 0:
        frame = frame.filter(pl.col(SEQ) >= base_seq)  # rows of earlier generations are not done
    if CURRENT in names:
        frame = frame.filter(pl.col(CURRENT).fill_null(True))
    shown = outputs or [c for c in names if c != id_column and c not in BOOKKEEPING]
    return frame.select([c for c in [id_column, *shown, ERROR] if c in names])
