"""Local disk: a temporary file, ``fsync`` and ``os.replace``.

So a reader never sees half a file, and a crash never leaves one under the real name.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterable, Iterator
from typing import ClassVar

from checkpoint_assets.engine.errors import StorageError
from checkpoint_assets.engine.storage.base import Store
from checkpoint_assets.engine.storage.errors import refused, translate

_TEMPORARY = re.compile(r"\.tmp-[0-9a-f]{12}$")


def temporary_path(path: str) -> str:
    """Where a write of ``path`` goes before ``os.replace`` (or ``os.link``) puts it in place."""
    return f"{path}.tmp-{uuid.uuid4().hex[:12]}"


def is_temporary(path: str) -> bool:
    """Is ``path`` a temporary file of a write (left behind if the writer was killed)?"""
    return _TEMPORARY.search(path) is not None


class LocalStore(Store):
    """A local folder: atomic writes through a temporary file, fsync and ``os.replace``."""

    local: ClassVar[bool] = True

    def put(self, path: str, data: bytes) -> None:
        self._count("PUT")
        self._make_folder(os.path.dirname(path))
        tmp = temporary_path(path)
        try:
            with translate(self, path, "writing"):
                self._create(tmp, data, path, "writing")
                os.replace(tmp, path)
        except BaseException:
            remove_quietly(tmp)
            raise

    @contextlib.contextmanager
    def put_file(self, path: str) -> Iterator[str]:
        self._make_folder(os.path.dirname(path))
        tmp = temporary_path(path)  # beside ``path``: replacing it is atomic
        try:
            self._create(tmp, b"", path, "writing")  # refused here, not inside the writer
            yield tmp
            self._count("PUT")
            with translate(self, path, "writing"):
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, path)
        finally:
            remove_quietly(tmp)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        self._count("PUT")
        self._make_folder(os.path.dirname(path))
        # Write the content under a temporary name first, then link it into place: link fails
        # when the target exists, so no reader ever sees an empty lock file.
        tmp = temporary_path(path)
        try:
            with translate(self, path, "creating"):
                self._create(tmp, data, path, "creating")
                os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            remove_quietly(tmp)
        return True

    def _create(self, tmp: str, data: bytes, path: str, action: str) -> None:
        """Write ``tmp`` (the temporary file of ``path``) in a folder that exists.

        A file the operating system refuses there is a ``StorageError``, not a "missing file".
        """
        try:
            _write(tmp, data)
        except FileExistsError:
            raise
        except OSError as e:
            raise refused(self, path, e, action) from e

    def _make_folder(self, folder: str) -> None:
        """Create ``folder`` and its parents; a file in the way, or a folder the operating
        system refuses, is a ``StorageError`` that names it."""
        try:
            os.makedirs(folder, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:
            blocker = _file_in_the_way(folder) or folder
            raise StorageError(
                f"Checkpoint storage error while creating the folder "
                f"{self.display(folder)}: {blocker} is a file, not a folder "
                f"({type(e).__name__}: {e}). Stored work is unchanged.",
                "Point base_dir at a folder (it is created if missing), or move the file away.",
            ) from e
        except OSError as e:
            raise refused(self, folder, e, "creating the folder") from e

    def delete(self, paths: Iterable[str]) -> None:
        for path in paths:
            self._count("DELETE")
            with translate(self, path, "deleting"):
                remove_quietly(path)


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _file_in_the_way(folder: str) -> str | None:
    """The nearest existing path at or above ``folder`` when it is not a folder."""
    path = os.path.abspath(folder)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None if os.path.isdir(path) else path


def remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
