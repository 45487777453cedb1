"""Where things live under a checkpoint root: the one home of every file-name rule.

One checkpoint per (asset, checkpoint tag, partition), named ``<asset path>/<tag>/<partition>``
relative to the root (``UNPARTITIONED`` for an unpartitioned asset):

- ``<name>.parquet``: the merged result of all finalized work.
- ``<name>.parquet.parts/part-<first>-<last>-<uuid>.parquet``: unmerged rows of flushes
  ``<first>`` to ``<last>``.
- ``<name>.parquet.meta.json``: job and input fingerprints, scheme, schema.
- ``<name>.parquet.lock``: the single writer's lease.
- ``<name>.parquet.quarantine/<file>.<UTC time>-<hex>.damaged``: damaged files moved aside.
  They are never read again, and deleted only by ``checkpoint-assets clean``.
- ``<name>.parquet.submissions/<tag>.json``: one provider batch submission of the checkpoint's
  rows (``submission_records.py``); ``<name>.parquet.submissions/queue.waiting``: how many of its
  rows wait for room in the provider's queue, while some do.

The shards that submit to one provider queue share what waits in it through
``_provider_queues/<queue key>/``: one claim per submission waiting there (``<tag>.json``) and the
limits its refusals stated (``limits.json``), see ``engine/providers/queue.py``.

Ordinary (not checkpointed) outputs of the IO manager go to ``<asset path>.parquet``, or
``<asset path>/<partition>.parquet`` for a partition. The global resume table of one tag goes to
``<asset path>_global_resume/<tag>.parquet``, as if the tag were a partition of that asset.

Every component of a name is encoded so that no name can reach outside the root. The components
are each part of the asset key, the tag and the partition key. Characters other than letters,
digits and ``-_.=+,@`` are percent-encoded (``/`` becomes ``%2F``). ``.`` or ``..`` alone become
``%2E`` / ``%2E%2E``. Names of ordinary shard keys and tags (``03-of-16``, ``default``) are
unchanged.
"""

from __future__ import annotations

import posixpath
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar
from urllib.parse import quote, unquote

T = TypeVar("T")

DEFAULT_TAG = "default"
# The partition of an unpartitioned asset's checkpoint (and the sensor's name for it).
UNPARTITIONED = "all"

MERGED = ".parquet"
PARTS = ".parquet.parts"
META = ".parquet.meta.json"
LOCK = ".parquet.lock"
QUARANTINE = ".parquet.quarantine"
SUBMISSIONS = ".parquet.submissions"
QUEUES = "_provider_queues"
_PART = re.compile(r"^part-(\d+)-(\d+)-[0-9a-f]+\.parquet$")
_SAFE = "-_.=+,@"


def encode(component: str, what: str = "name") -> str:
    """``component`` as one safe path component (see the module docstring)."""
    if not component:
        raise ValueError(f"A checkpoint {what} cannot be empty.")
    out = quote(component, safe=_SAFE)
    if out in (".", ".."):
        out = out.replace(".", "%2E")
    return out


def decode(component: str) -> str:
    return unquote(component)


def checkpoint_name(asset_path: Sequence[str], tag: str | None, partition: str | None) -> str:
    """The name of the checkpoint of one asset partition under one tag."""
    return posixpath.join(
        *(encode(p, "asset key") for p in asset_path),
        encode(tag or DEFAULT_TAG, "tag"),
        encode(partition, "partition key") if partition is not None else UNPARTITIONED,
    )


def asset_folder(asset_path: Sequence[str], tag: str | None = None) -> str:
    """The folder of every checkpoint of an asset (of one tag, when given)."""
    parts = [encode(p, "asset key") for p in asset_path]
    if tag is not None:
        parts.append(encode(tag, "tag"))
    return posixpath.join(*parts)


def output_name(asset_path: Sequence[str], partition: str | None) -> str:
    """Where an ordinary (not checkpointed) output of an asset partition is stored."""
    parts = [encode(p, "asset key") for p in asset_path]
    if partition is None:
        return posixpath.join(*parts[:-1], f"{parts[-1]}.parquet")
    return posixpath.join(*parts, f"{encode(partition, 'partition key')}.parquet")


def split_name(name: str) -> tuple[str, str, str]:
    """(asset, tag, partition) of a checkpoint name, decoded for display."""
    parts = name.split("/")
    if len(parts) < 3:
        return decode(name), "-", "-"
    return "/".join(decode(p) for p in parts[:-2]), decode(parts[-2]), decode(parts[-1])


@dataclass(frozen=True)
class Files:
    """The full paths of one checkpoint's files (under a store's root)."""

    merged: str
    parts: str
    meta: str
    lock: str
    quarantine: str
    submissions: str

    @classmethod
    def under(cls, root: str, name: str) -> Files:
        base = posixpath.join(root, name)
        return cls(
            base + MERGED,
            base + PARTS,
            base + META,
            base + LOCK,
            base + QUARANTINE,
            base + SUBMISSIONS,
        )

    def owns(self, path: str) -> bool:
        """Is ``path`` one of this checkpoint's files (merged, meta, lock, parts)?"""
        return path == self.merged or path.startswith(self.merged + ".")

    def quarantined(self, path: str, when: float) -> str:
        """Where the damaged file ``path`` goes when moved aside at ``when`` (seconds since the
        epoch). The ``.damaged`` suffix keeps it from ever looking like a part, merged or meta."""
        stamp = datetime.fromtimestamp(when, UTC).strftime("%Y%m%dT%H%M%SZ")
        name = f"{posixpath.basename(path)}.{stamp}-{uuid.uuid4().hex[:6]}.damaged"
        return posixpath.join(self.quarantine, name)

    def submission(self, tag: str) -> str:
        """The record of the provider batch submission ``tag``."""
        return posixpath.join(self.submissions, f"{tag}.json")

    @property
    def queue_waiting(self) -> str:
        """How many rows wait for room in the provider's queue (absent when none)."""
        return posixpath.join(self.submissions, "queue.waiting")

    def new_part(self, first: int, last: int) -> str:
        return posixpath.join(
            self.parts, f"part-{first:012d}-{last:012d}-{uuid.uuid4().hex[:12]}.parquet"
        )


def queue_folder(root: str, key: str) -> str:
    """The folder of the provider queue ``key``'s claims and stated limits (module docstring)."""
    return posixpath.join(root, QUEUES, encode(key, "queue key"))


def part_range(file_name: str) -> tuple[int, int] | None:
    """(first, last) flush of a part file's name; None for anything else (temporary files)."""
    match = _PART.match(file_name)
    return (int(match[1]), int(match[2])) if match else None


def names_in(paths: Iterable[str], root: str) -> list[str]:
    """Names of the checkpoints whose meta file is among ``paths`` (full paths under ``root``)."""
    return sorted(posixpath.relpath(p, root)[: -len(META)] for p in paths if p.endswith(META))


def files_by_name(paths: Iterable[tuple[str, T]], root: str) -> dict[str, list[T]]:
    """Group listed files (``(full path, info)`` pairs) by the checkpoint that owns them.

    It takes one pass. Comparing each file with each checkpoint would take minutes for
    thousands of shards.
    """
    listing = list(paths)
    found: dict[str, list[T]] = {name: [] for name in names_in((p for p, _ in listing), root)}
    by_merged = {posixpath.join(root, name) + MERGED: name for name in found}
    for path, info in listing:
        at = path.find(MERGED)
        while at >= 0:  # the merged path is the file's path up to one of its ".parquet"
            end = at + len(MERGED)
            name = by_merged.get(path[:end])
            if name is not None and path[end : end + 1] in ("", "."):
                found[name].append(info)
                break
            at = path.find(MERGED, at + 1)
    return found
