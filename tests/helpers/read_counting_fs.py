"""A local filesystem that records every byte range read from its files.

Registered as ``readcount://``, it works as a ``base_dir`` (``readcount:///tmp/x``) like any
fsspec filesystem: a test can then say which parts of a stored file a run read.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

PROTOCOL = "readcount"


class _CountingFile(LocalFileOpener):  # type: ignore[misc]
    def read(self, size: int = -1) -> bytes:
        start = self.tell()
        data: bytes = super().read(size)
        ReadCountingFileSystem.record(self.path, start, len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        start = self.tell()
        n: int = super().readinto(buffer)
        ReadCountingFileSystem.record(self.path, start, n)
        return n


class ReadCountingFileSystem(LocalFileSystem):  # type: ignore[misc]
    protocol = PROTOCOL
    reads: ClassVar[dict[str, list[tuple[int, int]]]] = {}  # path: (offset, length) of reads
    _lock = threading.Lock()

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"auto_mkdir": True, **kwargs})  # as object stores need no folders

    @classmethod
    def record(cls, path: str, start: int, length: int) -> None:
        with cls._lock:
            cls.reads.setdefault(path, []).append((start, length))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "r" in mode and "+" not in mode:
            return _CountingFile(path, mode, fs=self, **kwargs)
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation(PROTOCOL, ReadCountingFileSystem, clobber=True)
