"""Which row groups of a stored Parquet file a shard's key range overlaps, and which were read
(byte ranges recorded by ``ReadCountingFileSystem``)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from checkpoint_assets.engine.hashing import shard_key_bounds
from checkpoint_assets.engine.scheme import shard_key_column
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
    meta = pq.read_metadata(path)
    spans = []
    for g in range(meta.num_row_groups):
        columns = [meta.row_group(g).column(c) for c in range(meta.num_columns)]
        start = min(c.dictionary_page_offset or c.data_page_offset for c in columns)
        spans.append((g, start, start + sum(c.total_compressed_size for c in columns)))
    size = Path(path).stat().st_size
    read = set()
    for offset, length in ReadCountingFileSystem.reads.get(path, []):
        if offset + length == size and length <= FOOTER_READ:
            continue  # the footer (metadata), read with whatever precedes it in 64 KiB
        read |= {g for g, a, b in spans if offset < b and offset + length > a}
    return read
