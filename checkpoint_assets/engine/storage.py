"""The storage layer: five operations every checkpoint needs, on any fsspec filesystem.

``put`` (atomic whole-file write), ``put_if_absent`` (conditional create, used by the lock),
``get``, ``list`` and ``delete``. There are two sides:

- ``LocalStore``: a temporary file, ``fsync`` and ``os.replace``, so a reader never sees half a
  file and a crash never leaves one under the real name.
- ``ObjectStore``: any other fsspec filesystem (S3 and S3-compatible stores through s3fs, GCS,
  Azure...). A PUT of one object is atomic by itself, so every write is exactly one PUT: no
  temporary object, no copy-then-delete "rename". Directory-listing caches are off so a resume
  sees what the previous run committed.

Both count the requests they make (``requests``), which the asset reports as metadata: object
stores charge and rate-limit per request.
"""

from __future__ import annotations

import collections
import os
import posixpath
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from checkpoint_assets.engine.errors import StorageError

# Filesystem packages fsspec needs for common schemes, named in the error when one is missing.
_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
}


@dataclass(frozen=True)
class FileInfo:
    """One listed file: its full path (without protocol), size in bytes and modification time."""

    path: str
    size: int
    mtime: float | None

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)


class Store:
    """A folder on some filesystem, with the operations a checkpoint needs."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        self.requests: collections.Counter[str] = collections.Counter()

    # -- paths ---------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """The full path of ``parts`` joined under the root."""
        return posixpath.join(self.root, *parts)

    def display(self, path: str) -> str:
        """``path`` as a URI a user can paste (``s3://bucket/...`` or a local path)."""
        rel = posixpath.relpath(path, self.root) if path != self.root else ""
        return self.url if not rel else f"{self.url}/{rel}"

    # -- operations ----------------------------------------------------------------------
    def put(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` atomically, replacing any previous content."""
        raise NotImplementedError

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` unless it exists; False when it already existed."""
        raise NotImplementedError

    def get(self, path: str) -> bytes:
        """The whole content of ``path`` (FileNotFoundError when absent)."""
        self.requests["GET"] += 1
        with _translate(self, path):
            return bytes(self.fs.cat_file(path))

    def get_or_none(self, path: str) -> bytes | None:
        try:
            return self.get(path)
        except FileNotFoundError:
            return None

    def list(self, folder: str) -> list[FileInfo]:
        """Files directly inside ``folder``; empty when it does not exist."""
        self.requests["LIST"] += 1
        try:
            with _translate(self, folder):
                entries = self.fs.ls(folder, detail=True)
        except FileNotFoundError:
            return []
        return [
            FileInfo(str(e["name"]).rstrip("/"), int(e.get("size") or 0), _mtime(e))
            for e in entries
            if e.get("type") == "file"
        ]

    def list_recursive(self, folder: str) -> list[FileInfo]:
        """Every file under ``folder``, at any depth."""
        self.requests["LIST"] += 1
        try:
            with _translate(self, folder):
                found = self.fs.find(folder, detail=True)
        except FileNotFoundError:
            return []
        return [FileInfo(str(p), int(e.get("size") or 0), _mtime(e)) for p, e in found.items()]

    def delete(self, paths: Iterable[str]) -> None:
        """Delete files; a file that is already gone is not an error."""
        todo = list(paths)
        if not todo:
            return
        self.requests["DELETE"] += 1
        with _translate(self, todo[0]):
            for path in todo:
                try:
                    self.fs.rm_file(path)
                except FileNotFoundError:
                    pass


class LocalStore(Store):
    """A local folder: atomic writes through a temporary file, fsync and ``os.replace``."""

    def put(self, path: str, data: bytes) -> None:
        self.requests["PUT"] += 1
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _remove_quietly(tmp)
            raise

    def put_if_absent(self, path: str, data: bytes) -> bool:
        self.requests["PUT"] += 1
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Write the content under a temporary name first, then link it into place: link fails
        # when the target exists, so no reader ever sees an empty lock file.
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            _remove_quietly(tmp)
        return True

    def delete(self, paths: Iterable[str]) -> None:
        for path in paths:
            self.requests["DELETE"] += 1
            _remove_quietly(path)


class ObjectStore(Store):
    """An object store (or any non-local fsspec filesystem): every write is one PUT."""

    def put(self, path: str, data: bytes) -> None:
        self.requests["PUT"] += 1
        with _translate(self, path):
            self.fs.pipe_file(path, data)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        self.requests["PUT"] += 1
        try:
            with _translate(self, path):
                self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True

    def delete(self, paths: Iterable[str]) -> None:
        todo = list(paths)
        if not todo:
            return
        # One batched request per 1,000 keys on S3 (DeleteObjects).
        self.requests["DELETE"] += (len(todo) + 999) // 1000
        with _translate(self, todo[0]):
            try:
                self.fs.rm(todo)
            except FileNotFoundError:
                pass


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """The store for a local path or fsspec URI (``s3://bucket/prefix``, ``gs://...``).

    ``storage_options`` go to the filesystem's constructor. A scheme whose package is not
    installed fails with a ``StorageError`` that names the package.
    """
    options = dict(storage_options or {})
    protocol, _ = fsspec.core.split_protocol(url)
    if protocol in (None, "file", "local"):
        root = os.path.abspath(os.path.expanduser(fsspec.core.strip_protocol(url)))
        return LocalStore(LocalFileSystem(), root, root)
    options.setdefault("use_listings_cache", False)
    try:
        fs_cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as e:
        package = _PACKAGES.get(protocol) or _known_package(protocol)
        hint = f"pip install {package}" if package else "install the fsspec filesystem for it"
        raise StorageError(
            f"Cannot open checkpoint storage {url!r}: the filesystem for '{protocol}://' is not "
            f"available ({e}). Install it ({hint}) in the environment that runs the asset."
        ) from e
    if protocol in ("s3", "s3a"):
        options.setdefault("cache_regions", False)
    try:
        fs = fs_cls(**options)
    except TypeError as e:
        raise StorageError(f"Invalid storage_options for {url!r}: {e}") from e
    root = fs._strip_protocol(url)
    return ObjectStore(fs, root, f"{protocol}://{root}")


def _known_package(protocol: str) -> str | None:
    known = fsspec.registry.known_implementations.get(protocol, {})
    err = str(known.get("err", ""))
    # fsspec's messages read like "Install s3fs to access S3".
    words = err.split()
    if len(words) >= 2 and words[0].lower() == "install":
        return words[1]
    return None


def _mtime(entry: Mapping[str, Any]) -> float | None:
    value = entry.get("mtime") or entry.get("LastModified") or entry.get("last_modified")
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class _translate:
    """Turn a backend's low-level failure into a StorageError that says what to check.

    FileNotFoundError and FileExistsError pass through: callers handle them.
    """

    def __init__(self, store: Store, path: str) -> None:
        self.store = store
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, (FileNotFoundError, FileExistsError, StorageError)):
            return False
        if not isinstance(exc, Exception):
            return False
        where = self.store.display(self.path)
        text = f"{type(exc).__name__}: {exc}"
        lowered = text.lower()
        if isinstance(exc, PermissionError) or "accessdenied" in lowered or "forbidden" in lowered:
            why = "access was denied; check the credentials and the bucket policy"
        elif "nosuchbucket" in lowered or "bucket does not exist" in lowered:
            why = "the bucket does not exist; create it or fix base_dir"
        elif "connect" in lowered or "endpoint" in lowered or "timed out" in lowered:
            why = "the storage endpoint cannot be reached; check endpoint_url and the network"
        else:
            return False
        raise StorageError(
            f"Checkpoint storage error at {where}: {why} ({text}). Stored work is unchanged."
        ) from exc
