"""Compaction: keep a long run's unmerged parts bounded, merging them from memory.

Once ``COMPACT_AT`` (56) parts exist, eight consecutive parts of the same size class are merged
into one part covering their range. This is size-tiered, as in a log-structured merge tree. So a
run never holds more than 64 parts, and each row is rewritten only a logarithmic number of times.
Short runs are not compacted at all: finalize merges their parts once. A crash after the merged
part is written but before its inputs are deleted is harmless: readers skip a part covered by a
larger one.

Parts this process wrote stay in a ``PartCache`` (up to 256 MiB). So compaction and finalize merge
them without reading them back. Memory stays bounded whatever the outputs' size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

COMPACT_FANOUT = 8
COMPACT_AT = 56  # compaction starts here, so a run never holds more than 64 unmerged parts
CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Part:
    """An unmerged part file covering flushes ``first``..``last``."""

    path: str
    first: int
    last: int
    size: int

    @property
    def span(self) -> int:
        return self.last - self.first + 1

    @property
    def level(self) -> int:
        return int(math.log(self.span, COMPACT_FANOUT) + 1e-9)


class PartCache:
    """The rows of parts this process wrote, oldest evicted first beyond ``CACHE_BYTES``."""

    def __init__(self) -> None:
        self._rows: dict[str, pl.DataFrame] = {}
        self._bytes = 0.0

    def remember(self, path: str, rows: pl.DataFrame) -> None:
        self._rows[path] = rows
        self._bytes += rows.estimated_size()
        while self._bytes > CACHE_BYTES and len(self._rows) > 1:
            oldest = next(iter(self._rows))
            self._bytes -= self._rows.pop(oldest).estimated_size()

    def get(self, path: str) -> pl.DataFrame | None:
        return self._rows.get(path)

    def take(self, path: str) -> pl.DataFrame | None:
        rows = self._rows.pop(path, None)
        if rows is not None:
            self._bytes -= rows.estimated_size()
        return rows

    def clear(self) -> None:
        self._rows.clear()
        self._bytes = 0.0


def mergeable_run(parts: Sequence[Part]) -> int | None:
    """Index of the oldest run of ``COMPACT_FANOUT`` consecutive parts of the lowest level, once
    ``COMPACT_AT`` parts exist; None when nothing needs merging.

    Merging the oldest run of a level puts the merged part right after the parts of the next
    level up. That keeps parts ordered from the largest level to the smallest. So once
    ``COMPACT_AT`` parts exist, some level has a run of eight to merge.
    """
    if len(parts) < COMPACT_AT:
        return None
    for level in sorted({p.level for p in parts}):
        count = 0
        for i, part in enumerate(parts):
            count = count + 1 if part.level == level else 0
            if count == COMPACT_FANOUT:
                return i - COMPACT_FANOUT + 1
    return None
