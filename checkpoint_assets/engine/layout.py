"""Where a checkpoint's files live under a store's root, and how to find checkpoints.

One checkpoint per (asset, checkpoint tag, partition), named ``<asset path>/<tag>/<partition>``
relative to the root (``all`` for an unpartitioned asset)::

    <name>.parquet                     merged result of all finalized work
    <name>.parquet.parts/part-<first>-<last>-<uuid>.parquet
                                       unmerged rows of flushes <first>..<last>
    <name>.parquet.meta.json           job and input fingerprints, scheme, schema
    <name>.parquet.lock                the single writer's lease

A checkpoint exists when its meta file does: that is how checkpoints are found in a listing.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from checkpoint_assets.engine.checkpoint import Checkpoint
    from checkpoint_assets.engine.storage import FileInfo, Store

MERGED = ".parquet"
PARTS = ".parquet.parts"
META = ".parquet.meta.json"
LOCK = ".parquet.lock"


def split_name(name: str) -> tuple[str, str, str]:
    """(asset, tag, partition) of a checkpoint name; an asset key with a prefix keeps its ``/``.

    >>> split_name("team/ticket_routing/default/03-of-16")
    ('team/ticket_routing', 'default', '03-of-16')
    """
    parts = name.split("/")
    if len(parts) < 3:
        return name, "-", "-"
    return "/".join(parts[:-2]), parts[-2], parts[-1]


def belongs(path: str, checkpoint: Checkpoint) -> bool:
    """Is ``path`` one of the checkpoint's files (merged, parts, meta, lock)?"""
    return path == checkpoint.merged_path or path.startswith(checkpoint.merged_path + ".")


def names_in(store: Store, listing: Iterable[FileInfo]) -> list[str]:
    """Names of the checkpoints whose meta file is in ``listing`` (files under ``store``)."""
    return sorted(
        posixpath.relpath(f.path, store.root)[: -len(META)]
        for f in listing
        if f.path.endswith(META)
    )


def files_by_name(store: Store, listing: Iterable[FileInfo]) -> dict[str, list[FileInfo]]:
    """The files of every checkpoint in ``listing``, by name (see ``belongs``), in one pass:
    comparing each file with each checkpoint would take minutes for thousands of shards."""
    listing = list(listing)
    found: dict[str, list[FileInfo]] = {name: [] for name in names_in(store, listing)}
    by_merged = {store.path(name + MERGED): name for name in found}
    for info in listing:
        at = info.path.find(MERGED)
        while at >= 0:  # the merged path is the file's path up to one of its ".parquet"
            end = at + len(MERGED)
            name = by_merged.get(info.path[:end])
            if name is not None and info.path[end : end + 1] in ("", "."):
                found[name].append(info)
                break
            at = info.path.find(MERGED, at + 1)
    return found
