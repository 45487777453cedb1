"""Object stores: a PUT of one object is atomic by itself, so a checkpoint file write is one PUT.

- ``ObjectStore``: any non-local fsspec filesystem (GCS, Azure...). No temporary object, no
  copy-then-delete "rename". Directory-listing caches are off so a resume sees what the previous
  run committed. The conditional create is fsspec's ``pipe_file(mode="create")``. gcsfs sends
  ``ifGenerationMatch=0`` and adlfs ``If-None-Match: *``. The server refuses either when the
  object exists (412/409, raised as ``FileExistsError``). Both are tested racing against
  emulators. A filesystem that ignores ``mode`` would overwrite: only these are tested.
- ``S3Store``: S3 and S3-compatible stores (MinIO, Ceph, R2) through s3fs. The conditional create
  is a PUT with ``If-None-Match: *``, which the server refuses when the object exists. So two
  writers racing for a lock never both win. Listings and deletes are plain S3 calls (one request
  per 1,000 keys). The ``ls`` of s3fs lists the parent too for an empty folder, and its ``find``
  adds a HEAD.

A file written whole from a local file (a stored source, the global resume table) may be larger
than two parts. It then goes to S3 as a multipart upload of ``_PART_BYTES`` parts,
``_PARTS_AT_ONCE`` at a time. Against a moto server, uploading a 1.2 GiB file this way raises the
peak RSS by 148 MiB and takes 25 s. With the default of s3fs (ten parts of 50 MiB at once), it
raises it by 1,020 MiB and takes 30 s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Any, ClassVar

from checkpoint_assets.engine.errors import StorageError
from checkpoint_assets.engine.storage.base import FileInfo, Listing, Store, mtime
from checkpoint_assets.engine.storage.errors import error_codes, translate, why_code

_DELETE_BATCH = 1000  # keys per S3 DeleteObjects request
_PART_BYTES = 16 * 1024**2  # a multipart upload's parts (larger past S3's 10,000 parts)
_MAX_PARTS = 10_000
_PARTS_AT_ONCE = 4


class ObjectStore(Store):
    """An object store (or any non-local fsspec filesystem): every write is one PUT."""

    # Object stores charge per request: flushes wait at least this long since the previous one.
    min_flush_seconds: ClassVar[float] = 5.0

    def put(self, path: str, data: bytes) -> None:
        self._count("PUT")
        with translate(self, path, "writing"):
            self.fs.pipe_file(path, data)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        self._count("PUT")
        try:
            with translate(self, path, "creating"):
                self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except OSError as e:
            # S3 answers 409 when another conditional write of the same key is in flight.
            if "ConditionalRequestConflict" in error_codes(e):
                return False
            raise
        return True

    def delete(self, paths: Iterable[str]) -> None:
        todo = list(paths)
        if not todo:
            return
        self._count("DELETE", (len(todo) + _DELETE_BATCH - 1) // _DELETE_BATCH)
        # A missing file is fine; a missing bucket is not (_translate raises for it first).
        with contextlib.suppress(FileNotFoundError), translate(self, todo[0], "deleting"):
            self.fs.rm(todo)


class S3Store(ObjectStore):
    """S3 and S3-compatible stores: a read is one GET, a listing or delete one request per
    1,000 keys."""

    def get(self, path: str) -> bytes:
        self._count("GET")
        with translate(self, path, "reading"):
            # max_concurrency=1: otherwise s3fs sends a HEAD first (to split large downloads),
            # and a HEAD plus a LIST for a file that does not exist.
            return self._read(bytes(self.fs.cat_file(path, max_concurrency=1)))

    def _upload(self, local: str, path: str) -> None:
        size = os.path.getsize(local)
        part = max(_PART_BYTES, -(-size // _MAX_PARTS))
        # s3fs sends one PUT below two parts; above, a multipart upload: create, parts, complete.
        self._count("PUT", 1 if size < 2 * part else -(-size // part) + 2)
        self.fs.put_file(local, path, chunksize=part, max_concurrency=_PARTS_AT_ONCE)

    def list(self, folder: str) -> Listing:
        return self._list(folder, recursive=False)

    def list_recursive(self, folder: str) -> Listing:
        return self._list(folder, recursive=True)

    def _list(self, folder: str, recursive: bool) -> Listing:
        bucket, key, _ = self.fs.split_path(folder)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": f"{key.strip('/')}/" if key else ""}
        if not recursive:
            kwargs["Delimiter"] = "/"
        found: Listing = []
        with translate(self, folder, "listing"):
            while True:
                self._count("LIST")
                page = self.fs.call_s3("list_objects_v2", **kwargs)
                found.extend(
                    FileInfo(f"{bucket}/{obj['Key']}", int(obj.get("Size") or 0), mtime(obj))
                    for obj in page.get("Contents", [])
                    if not obj["Key"].endswith("/")  # folder markers some tools create
                )
                if not page.get("IsTruncated"):
                    return found
                kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def delete(self, paths: Iterable[str]) -> None:
        by_bucket: dict[str, list[str]] = {}
        for path in paths:
            bucket, key, _ = self.fs.split_path(path)
            by_bucket.setdefault(bucket, []).append(key)
        for bucket, keys in by_bucket.items():
            for i in range(0, len(keys), _DELETE_BATCH):
                chunk = keys[i : i + _DELETE_BATCH]
                self._count("DELETE")
                where = f"{bucket}/{chunk[0]}"
                with translate(self, where, "deleting"):
                    out = self.fs.call_s3(
                        "delete_objects",
                        Bucket=bucket,
                        Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True},
                    )
                # DeleteObjects answers 200 and lists the keys it could not delete.
                errors = out.get("Errors") or []
                if errors:
                    first = errors[0]
                    code = str(first.get("Code", ""))
                    why = why_code(code) or "the store refused to delete them"
                    raise StorageError(
                        f"Checkpoint storage error while deleting {len(errors)} file(s) such as "
                        f"{self.display(bucket + '/' + str(first.get('Key')))}: {why} "
                        f"({code}: {first.get('Message', '')}). Stored work is unchanged."
                    )
