"""Keeping the result store bounded: deleting by age and size, merging small files.

``clean`` deletes whole files, oldest first (a file's age is in its name: ``layout.py``).
``merge`` replaces the files of a bucket by one: the merged file is written under a new name
first, with a key filter of all its rows (``key_filter.py``), then the small ones are deleted.
A reader that listed them and finds one gone lists again (``store.py``), so nothing is
rewritten under a reader. A merged file takes the time of its newest result.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import polars as pl

from checkpoint_assets.engine.reuse.layout import KEYS, bucket_of, new_file, scope_of, written_at
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.storage.base import FileInfo

# A bucket with more files than this is merged into one by ``merge``.
MERGE_AT = 8


@dataclass
class Cleaned:
    """What a clean deleted and merged."""

    deleted: list[FileInfo] = field(default_factory=list)
    merged: int = 0  # small files merged away
    kept_bytes: int = 0

    @property
    def deleted_bytes(self) -> int:
        return sum(f.size for f in self.deleted)


def clean(
    results: ResultStore,
    *,
    older_than: float | None = None,
    max_bytes: int | None = None,
    now: float | None = None,
) -> Cleaned:
    """Delete result files written more than ``older_than`` seconds before ``now``, then the
    oldest until the store holds at most ``max_bytes``; then merge each bucket's small files."""
    files = results.files()
    done = Cleaned(deleted=chosen(files, older_than=older_than, max_bytes=max_bytes, now=now))
    results.store.delete(f.path for f in done.deleted)
    deleted = {f.path for f in done.deleted}
    done.merged = merge(results, [f for f in files if f.path not in deleted])
    done.kept_bytes = sum(f.size for f in results.files())
    return done


def chosen(
    files: list[FileInfo],
    *,
    older_than: float | None = None,
    max_bytes: int | None = None,
    now: float | None = None,
) -> list[FileInfo]:
    """The files of ``files`` (oldest first) that ``clean`` deletes."""
    now = time.time() if now is None else now
    cutoff = -math.inf if older_than is None else now - older_than
    gone = [f for f in files if (written_at(f.path) or now) < cutoff]
    left = [f for f in files if (written_at(f.path) or now) >= cutoff]
    if max_bytes is not None:
        total = sum(f.size for f in left)
        while left and total > max_bytes:
            total -= left[0].size
            gone.append(left.pop(0))
    return gone


def merge(results: ResultStore, files: list[FileInfo]) -> int:
    """Merge the buckets among ``files`` holding more than ``MERGE_AT`` files; returns how many
    files were merged away."""
    by_bucket: dict[tuple[str, int], list[FileInfo]] = defaultdict(list)
    for f in files:
        index = bucket_of(f.path)
        if index is not None:
            by_bucket[(scope_of(f.path, results.root), index)].append(f)
    merged = 0
    for (scope, index), small in sorted(by_bucket.items()):
        if len(small) <= MERGE_AT:
            continue
        frames = [pl.read_parquet(results.store.get(f.path)) for f in small]
        rows = pl.concat(frames, how="diagonal_relaxed").unique(
            subset=list(KEYS), keep="first", maintain_order=True
        )
        newest = max(written_at(f.path) or 0.0 for f in small)
        results.write(new_file(results.root, scope, index, newest), rows)
        results.store.delete(f.path for f in small)
        merged += len(small)
    return merged
