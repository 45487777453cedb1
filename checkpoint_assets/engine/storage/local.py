"""Local disk: a temporary file, ``fsync`` and ``os.replace``, so a reader never sees half a file
and a crash never leaves one under the real name."""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterable
from typing import ClassVar

from checkpoint_assets.engine.storage.base import Store
from checkpoint_assets.engine.storage.errors import translate

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
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = temporary_path(path)
        try:
            with translate(self, path, "writing"):
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
        except BaseException:
            remove_quietly(tmp)
            raise

    def put_if_absent(self, path: str, data: bytes) -> bool:
        self._count("PUT")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Write the content under a temporary name first, then link it into place: link fails
        # when the target exists, so no reader ever sees an empty lock file.
        tmp = temporary_path(path)
        try:
            with translate(self, path, "creating"), open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            remove_quietly(tmp)
            raise
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            remove_quietly(tmp)
        return True

    def delete(self, paths: Iterable[str]) -> None:
        for path in paths:
            self._count("DELETE")
            remove_quietly(path)


def remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
