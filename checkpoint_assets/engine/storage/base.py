"""The storage contract: five operations every checkpoint needs, on any fsspec filesystem.

The five are ``put`` (atomic whole-file write), ``put_if_absent`` (conditional create, used by
the lock), ``get``, ``list`` and ``delete``. One file per backend implements them (``local.py``,
``objects.py``), and the same test suite runs against each.

Request budget. Every store counts the requests it makes (``requests``: PUT, GET, LIST, DELETE,
HEAD) and the bytes its GETs fetched (``bytes_read``). The asset reports both as materialization
metadata. Object stores charge and rate-limit per request (S3: about 3,500 writes per second per
prefix). On S3 a run into a new checkpoint makes:

- 13 requests to start and finish (lock, meta, merged file, listings);
- one PUT per flush;
- a PUT and a DELETE per compaction, at most one per seven parts beyond 55. Parts are merged
  from memory. A GET happens only for parts that no longer fit the writer's 256 MiB cache, or
  that an earlier run left;
- a GET and a PUT per lock renewal.

``Settings.request_budget`` adds them up: at most about 1.3 requests per flush. A store also says
how often a run may flush to it (``min_flush_seconds``). On object stores that is never more than
once per 5 s. So a shard makes at most about 0.3 requests per second whatever its speed, and a
fast shard pays for its duration, not its rows. Per million rows that is about
``13 + 1.3 * min(62,500, duration / 5 s)`` requests. That stays under 2,000 whenever a shard
computes at least ~150 rows per second. A flush every 16 rows would take up to about 80,000.
Measured on a moto server (``python -m bench.run --only s3_requests``): 21 requests for a million
fast rows in 56 s. ``tests/engine/storage/test_request_budget.py`` holds runs to the budget.
Reading a stored source or result lazily is a GET per byte range pyarrow asks for (``arrow.py``),
counted the same way.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import fsspec

from checkpoint_assets.engine.storage.errors import translate


@dataclass(frozen=True)
class Usage:
    """What a store was asked for: requests by kind, and the bytes its GETs fetched."""

    requests: Mapping[str, int]
    bytes_read: int

    def since(self, earlier: Usage) -> Usage:
        """What was asked for after ``earlier`` (a snapshot of the same store)."""
        requests = Counter(self.requests)
        requests.subtract(earlier.requests)
        return Usage(+requests, self.bytes_read - earlier.bytes_read)


@dataclass(frozen=True)
class FileInfo:
    """One listed file: its full path (without protocol), size in bytes and modification time."""

    path: str
    size: int
    mtime: float | None

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)


Listing = list[FileInfo]


class Store:
    """A folder on some filesystem, with the operations a checkpoint needs."""

    # Never flush more often than this by default (each flush costs requests on object stores).
    min_flush_seconds: ClassVar[float] = 0.0
    local: ClassVar[bool] = False

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        self.requests: Counter[str] = Counter()
        self.bytes_read = 0
        self._count_lock = threading.Lock()  # the lock's heartbeat thread writes too

    # -- paths ---------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """The full path of ``parts`` joined under the root."""
        return posixpath.join(self.root, *parts)

    def display(self, path: str) -> str:
        """``path`` as a URI a user can paste (``s3://bucket/...`` or a local path)."""
        rel = posixpath.relpath(path, self.root) if path != self.root else ""
        return self.url if not rel else f"{self.url}/{rel}"

    def _count(self, kind: str, n: int = 1) -> None:
        with self._count_lock:
            self.requests[kind] += n

    def _read(self, data: bytes) -> bytes:
        with self._count_lock:
            self.bytes_read += len(data)
        return data

    def usage(self) -> Usage:
        """What this store was asked for so far (``Usage.since`` an earlier one: in between)."""
        with self._count_lock:
            return Usage(Counter(self.requests), self.bytes_read)

    # -- operations ----------------------------------------------------------------------
    def put(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` atomically, replacing any previous content."""
        raise NotImplementedError

    @contextlib.contextmanager
    def put_file(self, path: str) -> Iterator[str]:
        """A local file to write ``path``'s content into, for a writer that streams.

        Polars' ``sink_parquet`` is such a writer. The file is stored whole when the block ends,
        never when it raises.
        """
        fd, local = tempfile.mkstemp(suffix=".parquet")
        os.close(fd)
        try:
            yield local
            with translate(self, path, "writing"):
                self._upload(local, path)
        finally:
            os.remove(local)

    def _upload(self, local: str, path: str) -> None:
        self._count("PUT")
        self.fs.put_file(local, path)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` unless it exists; False when it already existed."""
        raise NotImplementedError

    def get(self, path: str) -> bytes:
        """The whole content of ``path`` (FileNotFoundError when absent)."""
        self._count("GET")
        with translate(self, path, "reading"):
            return self._read(bytes(self.fs.cat_file(path)))

    def get_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (exclusive) of ``path``: one ranged GET."""
        self._count("GET")
        with translate(self, path, "reading"):
            return self._read(bytes(self.fs.cat_file(path, start=start, end=end)))

    def size(self, path: str) -> int:
        """The size of ``path`` in bytes (FileNotFoundError when absent): one HEAD."""
        self._count("HEAD")
        with translate(self, path, "reading"):
            return int(self.fs.size(path))

    def exists(self, path: str) -> bool:
        """Whether ``path`` is a file: one HEAD. Only a missing file is False; a failure to
        ask (no credentials, denied access) is a ``StorageError``, never "not there"."""
        self._count("HEAD")
        try:
            with translate(self, path, "reading"):
                info = self.fs.info(path)
        except FileNotFoundError:
            return False
        return bool(info.get("type") == "file")

    def get_or_none(self, path: str) -> bytes | None:
        try:
            return self.get(path)
        except FileNotFoundError:
            return None

    def list(self, folder: str) -> Listing:
        """Files directly inside ``folder``; empty when it does not exist."""
        self._count("LIST")
        try:
            with translate(self, folder, "listing"):
                entries = self.fs.ls(folder, detail=True)
        except FileNotFoundError:
            return []
        return [
            FileInfo(str(e["name"]).rstrip("/"), int(e.get("size") or 0), mtime(e))
            for e in entries
            if e.get("type") == "file"
        ]

    def list_recursive(self, folder: str) -> Listing:
        """Every file under ``folder``, at any depth."""
        self._count("LIST")
        try:
            with translate(self, folder, "listing"):
                found = self.fs.find(folder, detail=True)
        except FileNotFoundError:
            return []
        return [FileInfo(str(p), int(e.get("size") or 0), mtime(e)) for p, e in found.items()]

    def delete(self, paths: Iterable[str]) -> None:
        """Delete files; a file that is already gone is not an error."""
        todo = list(paths)
        if not todo:
            return
        self._count("DELETE")
        for path in todo:
            with contextlib.suppress(FileNotFoundError), translate(self, path, "deleting"):
                self.fs.rm_file(path)


def mtime(entry: Mapping[str, Any]) -> float | None:
    value = entry.get("mtime") or entry.get("LastModified") or entry.get("last_modified")
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
