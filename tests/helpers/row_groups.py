"""Which row groups of a stored Parquet file a shard's key range overlaps, and which were read
(byte ranges recorded by ``ReadCountingFileSystem``)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from checkpoint_assets.engine.sharding.hashing import shard_key_bounds
from checkpoint_assets.engine.sharding.scheme import shard_key_column
from helpers.read_counting_fs import ReadCountingFileSystem

FOOTER_READ = 64 * 1024  # pyarrow reads a file's last 64 KiB to find its metadata


def overlapping_groups(path: str, index: int, count: int, id_column: str = "ticket_id") -> set[int]:
    """The row groups whose shard key statistics overlap shard ``index`` of ``count``."""
    first, end = shard_key_bounds(index, count)
    meta = pq.read_metadata(path)
    column = meta.schema.names.index(shard_key_column(id_column))
    found = set()
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(column).statistics
        if stats.max >= first and (end is None or stats.min < end):
            found.add(g)
    return found


def groups_read(path: str) -> set[int]:
    """The row groups whose column chunks were read (byte ranges recorded by the filesystem)."""
    read: set[int] = set()
    for offset, length in ReadCountingFileSystem.reads.get(path, []):
        read |= groups_in(path, offset, length)
    return read


def groups_in(path: str, offset: int, length: int) -> set[int]:
    """The row groups whose column chunks a read of ``length`` bytes at ``offset`` touches
    (none for a read of the footer: the metadata, with whatever precedes it in 64 KiB)."""
    if offset + length == Path(path).stat().st_size and length <= FOOTER_READ:
        return set()
    meta = pq.read_metadata(path)
    found = set()
    for g in range(meta.num_row_groups):
        columns = [meta.row_group(g).column(c) for c in range(meta.num_columns)]
        start = min(c.dictionary_page_offset or c.data_page_offset for c in columns)
        end = start + sum(c.total_compressed_size for c in columns)
        if offset < end and offset + length > start:
            found.add(g)
    return found
