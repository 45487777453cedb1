"""The source of a checkpointed asset, read lazily: a shard's memory and reads follow the shard.

The chain, for an upstream stored by ``CheckpointIOManager``::

    upstream  ──> handle_output ──> stored.store_output(): rows ordered by the shard key of the id
                     column its checkpointed assets shard by, kept in a column ``_shard_key:<id>``
                     with statistics, in row groups of ``ROW_GROUP_ROWS`` rows: the keyed layout,
                     written in bounded memory (``keyed.py``; a LazyFrame is never collected whole)
    checkpointed ──> load_input    ──> scan()           a LazyFrame over the stored file
    asset body   ──> ShardRows(as_lazy(source), ...)    each shard read a key range at a time
                     (engine/plan/inputs.py); the reader skips row groups whose keys miss the range

Any other source is filtered by ``rows_in``: a LazyFrame an upstream returns, a DataFrame,
another IO manager's table. The shard key is computed from the id column as the rows stream
past into local files, one per shard, read back a batch at a time.

A partitioned source (``source_partition_mapping``) is one scan per partition, concatenated:
the filter reaches each, so a shard reads its slice of every partition.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds

from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.plan.inputs import SLICE_ROWS, FrameInputs, Inputs
from checkpoint_assets.engine.plan.resume import SOURCE_ROW, validate_ids
from checkpoint_assets.engine.rows import BOOKKEEPING, CURRENT, ERROR, SEQ, distinct_count
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.keyed import Buckets
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


EVERY_ROW = Shard(0, 1)  # what a partition key that is no shard takes
CHECK_ROWS = 1 << 24  # ids the whole-source check holds at a time (``ShardRows.check_ids``)


class ShardRows:
    """The input rows of each shard of one run, read a slice at a time (engine/plan/inputs.py).

    No shard's input is held whole. Where their ids will be refused (null or duplicated), each
    row carries its row in the source (``SOURCE_ROW``). A stored source stores it; for another,
    it is found by reading the source's id column once more, on that error path only.

    The filter is applied to the source as it is, so polars pushes it down to the scan: the
    source's own computed columns are computed for these rows only.

    - A stored source (ordered by the shard key) is read a key range of about ``SLICE_ROWS``
      rows at a time. Each read takes the few row groups its range overlaps.
    - With ``remote`` (off local disk), its slices are kept in local files as they are first
      fetched, and read again from them.
    - Any other source streams once into local files, one per shard (``keyed.Buckets``). They
      are read back a batch at a time, held in memory when they fit in its buffer.

    A partition key that is no shard takes every row. Use as a context manager: the local files
    are removed at its end.
    """

    def __init__(
        self,
        source: pl.LazyFrame,
        id_column: str,
        keys: Sequence[str | None],
        *,
        remote: bool = False,
    ) -> None:
        schema = source.collect_schema()
        self.remote = remote  # a stored source off local disk: fetched once, kept locally
        self.spools: list[_Spool] = []
        self.numbered = SOURCE_ROW in schema  # stored with the source
        if not self.numbered and any(c.startswith(SHARD_KEY_PREFIX) for c in schema):
            # Stored ordered by shard key without its rows: their places are not known.
            source = source.with_columns(pl.lit(None, pl.UInt32).alias(SOURCE_ROW))
            self.numbered = True
        self.source = source
        self.id_column = id_column
        self.columns = [*user_columns(schema.names()), *([SOURCE_ROW] if self.numbered else [])]
        self.schema = pl.Schema({c: source.collect_schema()[c] for c in self.columns})
        self.keys = list(keys)
        # A key that is no shard (or none: unpartitioned) takes every row: the one shard of 1.
        shards = [(Shard.parse(k) if k is not None else None) or EVERY_ROW for k in keys]
        self.shards = list(dict.fromkeys(shards))  # each read once, whatever keys share it
        self.shard_of = dict(zip(self.keys, shards, strict=True))
        self.held: pl.DataFrame | None = None  # every row, when they fit in memory
        self.spill: Buckets | None = None
        if id_column not in schema:
            self.held = self.source.collect(engine="streaming")  # refused by prepare()
        elif shard_key_column(id_column) not in schema:
            self._spill(hashing.shard_key(id_column, schema[id_column]))

    def _spill(self, key: pl.Expr) -> None:
        """Stream the run's rows once into one local file per shard (by position in
        ``shards``); rows that fit in the buffer stay in memory."""
        position = pl.lit(None, pl.Int64)
        for index, shard in enumerate(self.shards):
            position = pl.when(shard_filter([shard], key)).then(index).otherwise(position)
        self.spill = Buckets(position)
        every = shard_filter(self.shards, key)
        for batch in self.source.filter(every).collect_batches():
            self.spill.add(batch)
        self.held = self.spill.in_memory()

    def __enter__(self) -> ShardRows:
        return self

    def __exit__(self, *exc: object) -> None:
        for spool in self.spools:
            spool.__exit__(*exc)
        if self.spill is not None:
            self.spill.__exit__(*exc)

    def check_ids(self, *, stored_clean: bool = False) -> None:
        """Refuse the run when an id anywhere in the source is null or duplicated, with the same
        error for every shard, before any computes: a broken source makes no shard materialize.

        ``stored_clean``: the source's stored files were found clean when they were written
        (``stored.ids_refused``), which their footers say: nothing is read. A partitioned source is
        so checked partition by partition; an id in two of its partitions is refused by the
        shard that holds it.

        Every copy of an id has the same shard key, and null ids have the first. So the source's
        ids are read by ranges of their keys, ``CHECK_ROWS`` at most at a time, each range
        checked on its own: a stored source by its key column (each range reads only its row
        groups), any other by the key computed as the ids stream past. An id column that is
        missing or of another type is left to each shard's own check, which names it.
        """
        dtype = self.schema.get(self.id_column)
        if stored_clean or dtype is None or not (dtype.is_integer() or dtype == pl.String):
            return
        column = shard_key_column(self.id_column)
        stored = column in self.source.collect_schema()
        key = pl.col(column) if stored else hashing.shard_key(self.id_column, dtype)
        rows = self.source.select(pl.len()).collect().item()
        parts = max(1, -(-rows // CHECK_ROWS))
        for index in range(parts):
            ids = self.source.select(self.id_column)
            if parts > 1:
                ids = self.source.filter(shard_filter([Shard(index, parts)], key))
            found = (
                ids.select(self.id_column).collect(engine="streaming").get_column(self.id_column)
            )
            if found.null_count() or distinct_count(found) != found.len():
                self._refuse(found)

    def _refuse(self, ids: pl.Series) -> None:
        """Raise the error of the null or duplicated ``ids``, with their rows in the source."""
        column = pl.col(self.id_column)
        refused = ids.filter(ids.is_duplicated()).drop_nulls().unique().implode()
        if self.numbered:  # stored with its source rows
            rows = (
                self.source.filter(column.is_null() | column.is_in(refused))
                .select(self.id_column, SOURCE_ROW)
                .collect(engine="streaming")
            )
        else:
            rows = self.numbered_ids(ids.filter(ids.is_null() | ids.is_in(refused)).to_frame())
        validate_ids(rows, self.id_column)

    def of(self, key: str | None) -> Inputs:
        """The input rows of shard ``key`` (or of a partition key that takes them all)."""
        shard = self.shard_of[key]
        index = self.shards.index(shard)
        if self.held is not None:
            rows = rows_in(self.held, self.id_column, [key]).select(self.columns)
            return _ShardInputs(self, FrameInputs(rows).slices)
        if self.spill is not None:
            spill = self.spill
            read = lambda columns: (f.select(columns) for f in spill.read(index))  # noqa: E731
            return _ShardInputs(self, read)
        return _ShardInputs(self, self._key_ranges(shard))

    def _key_ranges(self, shard: Shard) -> Callable[[Sequence[str]], Iterator[pl.DataFrame]]:
        """How to read ``shard`` of a stored source: a range of its keys at a time.

        Each range holds about ``SLICE_ROWS`` rows, counted from its key column first; keys are
        hashes, so they spread evenly. The reader skips the row groups outside each range by
        their statistics."""
        key = pl.col(shard_key_column(self.id_column))
        first, end = hashing.shard_key_bounds(shard.index, shard.count)
        count = self.source.filter(shard_filter([shard], key)).select(pl.len()).collect().item()
        parts = max(1, -(-count // SLICE_ROWS))
        top = (1 << 63) if end is None else end
        bounds = [first + (top - first) * i // parts for i in range(parts + 1)]
        ranges = [
            (key >= low) & (key < high) if high < (1 << 63) else key >= low
            for low, high in itertools.pairwise(bounds)
        ]
        source = self.source
        if not self.remote:
            return lambda columns: (source.filter(r).select(columns).collect() for r in ranges)
        spool = _Spool()
        self.spools.append(spool)
        kept: list[str] = []  # the columns spooled, once a first read has ended

        def read(columns: Sequence[str]) -> Iterator[pl.DataFrame]:
            """On the first read, each slice fetched is kept in a local file too; later reads
            of those columns come from it, so a remote source is fetched once."""
            if kept and set(columns) <= set(kept):
                yield from spool.read(columns)
                return
            for inside in ranges:
                rows = source.filter(inside).select(columns).collect()
                # Arrow's allocator keeps what the scan freed; polars holds the rows now.
                pa.default_memory_pool().release_unused()
                if not kept:
                    spool.add(rows)
                yield rows
            if not kept:
                kept.extend(columns)

        return read

    def numbered_ids(self, rows: pl.DataFrame) -> pl.DataFrame:
        """``rows`` (a shard's ids) with the source row of each whose id is null or duplicated,
        found by numbering the source's ids; unchanged when none is.

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


class _Spool:
    """Slices kept in local files, one Arrow IPC file each, uncompressed.

    They are written and read back at about memory speed. An LZ4 stream of the same rows takes
    about ten times the CPU."""

    def __init__(self) -> None:
        self.folder: str | None = None
        self.files: list[str] = []

    def add(self, rows: pl.DataFrame) -> None:
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix="checkpoint-assets-slices-")
        path = os.path.join(self.folder, f"{len(self.files)}.arrow")
        rows.write_ipc(path, compression="uncompressed")
        self.files.append(path)

    def read(self, columns: Sequence[str]) -> Iterator[pl.DataFrame]:
        for path in self.files:
            yield pl.read_ipc(path, columns=list(columns))

    def __exit__(self, *exc: object) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


class _ShardInputs(Inputs):
    """One shard's rows as ``ShardRows`` reads them (``read``: its reader of some columns)."""

    def __init__(
        self, rows: ShardRows, read: Callable[[Sequence[str]], Iterator[pl.DataFrame]]
    ) -> None:
        self.rows = rows
        self.read = read

    @property
    def schema(self) -> pl.Schema:
        return self.rows.schema

    def slices(self, columns: Sequence[str]) -> Iterator[pl.DataFrame]:
        return self.read(columns)

    def numbered(self, ids: pl.DataFrame) -> pl.DataFrame:
        return ids if self.rows.numbered else self.rows.numbered_ids(ids)


def scan(store: Store, path: str, *, checked: bool = False) -> pl.LazyFrame:
    """A lazy scan of the Parquet file at ``path``: filters on columns with statistics skip row
    groups, and only the row groups and columns a query needs are read.

    On local disk it is polars' own reader: parallel, strings decoded straight into polars'
    layout. On any other filesystem (S3...) it is pyarrow's. Each byte range it needs is one GET,
    counted in the store's requests (``storage/arrow.py``).

    ``checked``: read through pyarrow wherever the file is, every page's checksum checked
    (checkpoints' merged files carry them).
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
