"""pyarrow's view of a store, for lazy scans of stored Parquet.

Every read is one ranged GET, counted in the store (``requests``, ``bytes_read``) like any other
request.

fsspec's own file objects read ahead: s3fs fetches 50 MiB past each read. Through them, a shard's
scan of a stored source would fetch far more than its row groups, and nothing would count it.
The Parquet reader of pyarrow already asks for the byte ranges it needs, coalesced
(``pre_buffer``: ranges less than 8 KiB apart become one). So each read it makes is worth exactly
one request. A file's size is asked once (a HEAD), however often it is opened.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.fs as pafs

from checkpoint_assets.engine.storage.base import Store


def arrow_filesystem(store: Store) -> pafs.FileSystem:
    """A pyarrow filesystem over ``store``'s files that reads byte ranges, each counted."""
    return pafs.PyFileSystem(_CountedReads(store))


def ranged_file(store: Store, path: str, size: int) -> pa.PythonFile:
    """``path`` (of ``size`` bytes, as listed) as a pyarrow file: each read a counted ranged GET."""
    return pa.PythonFile(_RangedFile(store, path, size), mode="r")


class _CountedReads(pafs.FSSpecHandler):  # type: ignore[misc]
    def __init__(self, store: Store) -> None:
        super().__init__(store.fs)
        self.store = store
        self.sizes: dict[str, int] = {}

    def get_file_info(self, paths: Sequence[str]) -> list[pafs.FileInfo]:
        self.store._count("HEAD", len(paths))
        infos: list[pafs.FileInfo] = super().get_file_info(paths)
        for info in infos:
            if info.type == pafs.FileType.File:
                self.sizes[info.path] = info.size
        return infos

    def open_input_file(self, path: str) -> pa.PythonFile:
        if path not in self.sizes:
            self.sizes[path] = self.store.size(path)
        return pa.PythonFile(_RangedFile(self.store, path, self.sizes[path]), mode="r")


class _RangedFile(io.RawIOBase):
    """A read-only file whose every ``read`` is one ranged GET through the store."""

    def __init__(self, store: Store, path: str, size: int) -> None:
        super().__init__()
        self.store = store
        self.path = path
        self.length = size
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = base + offset
        return self.position

    def read(self, size: int | None = -1) -> bytes:
        end = self.length if size is None or size < 0 else min(self.length, self.position + size)
        if end <= self.position:
            return b""
        data = self.store.get_range(self.path, self.position, end)
        self.position += len(data)
        return data
