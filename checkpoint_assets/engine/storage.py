"""The storage layer: five operations every checkpoint needs, on any fsspec filesystem.

``put`` (atomic whole-file write), ``put_if_absent`` (conditional create, used by the lock),
``get``, ``list`` and ``delete``. There are three sides:

- ``LocalStore``: a temporary file, ``fsync`` and ``os.replace``, so a reader never sees half a
  file and a crash never leaves one under the real name.
- ``ObjectStore``: any other fsspec filesystem (GCS, Azure...). A PUT of one object is atomic by
  itself, so every write is exactly one PUT: no temporary object, no copy-then-delete "rename".
  Directory-listing caches are off so a resume sees what the previous run committed.
- ``S3Store``: S3 and S3-compatible stores (MinIO, Ceph, R2) through s3fs. Writes as above; the
  conditional create is a PUT with ``If-None-Match: *``, which the server refuses when the object
  exists, so two writers racing for a lock never both win. Listings and deletes are plain S3
  calls (one request per 1,000 keys): s3fs's own ``ls`` of an empty folder lists the parent too,
  and its ``find`` adds a HEAD. Calls give up after a bounded number of attempts (botocore's
  "standard" retries, 3 attempts, 5 s connect timeout, unless ``config_kwargs`` says otherwise),
  so an unreachable endpoint fails the run in seconds instead of hanging it.

Failures say which problem it is (``StorageError``): a missing filesystem package (named, as in
``pip install gcsfs``), a missing bucket, denied access, missing credentials, an unreachable
endpoint. A failed request changes nothing that is stored.

Request budget. Every store counts the requests it makes (``requests``: PUT, GET, LIST, DELETE),
which the asset reports as materialization metadata: object stores charge and rate-limit per
request (S3: about 3,500 writes per second per prefix). A run costs about 15 requests to start
and finish (meta, lock, merged file) plus about 1.4 per flush: one PUT per part, and compaction's
PUT and DELETE for every eight parts (parts are merged from memory; a GET happens only for parts
that no longer fit the writer's 256 MiB cache). On object stores a flush happens when
``checkpoint_interval`` rows are done *and* at least ``min_flush_seconds`` (default 5 s) have
passed since the previous one (or at ``flush_seconds``, 30 s, when rows come slowly), so a shard
makes at most one flush per 5 s, about 0.3 requests per second whatever its speed. Per million
rows that is about ``1.4 * min(62,500, duration / 5 s)`` requests: under 2,000 whenever a shard
computes at least ~150 rows per second (measured: 28 for a million fast rows), against 62,500+
for one part per 16 rows (measured: about 89,000 with compaction).

Loss bound. A hard kill (SIGKILL, a lost node) loses the rows done since the last flush: at
most ``max(checkpoint_interval, rows done in min_flush_seconds)`` rows, computed in at most
``max(min_flush_seconds, min(flush_seconds, time to compute checkpoint_interval rows))`` seconds,
plus the flush the background writer is writing (one at most, no larger) and the batches in
flight (``max_concurrency``). With the defaults on S3 and a function doing 100 rows per second
that is about 500 rows or 5 s of work, twice that if a write is under way; locally
(``min_flush_seconds`` 0) it is one batch of 16 rows, or two. SIGTERM, SIGINT and exceptions
flush before leaving and lose nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import posixpath
import threading
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations

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
_S3 = ("s3", "s3a")

# botocore settings for s3fs unless ``config_kwargs`` in storage_options says otherwise:
# "standard" retries (throttling, 5xx, dropped connections) with at most 3 attempts.
_S3_CONFIG: dict[str, Any] = {
    "connect_timeout": 5,
    "retries": {"max_attempts": 3, "mode": "standard"},
}
# s3fs retries a failed call again on top of botocore; once more is enough (it covers a body
# that broke off while being read, which botocore does not retry).
_S3FS_RETRIES = 2
_DELETE_BATCH = 1000  # keys per S3 DeleteObjects request

# S3 error codes, by what the user has to fix.
_DENIED = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "403"}
_REJECTED = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
_UNREACHABLE = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ProxyConnectionError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ConnectionError",
    "TimeoutError",
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


Listing = list[FileInfo]


class Store:
    """A folder on some filesystem, with the operations a checkpoint needs."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        self.requests: Counter[str] = Counter()
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

    # -- operations ----------------------------------------------------------------------
    def put(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` atomically, replacing any previous content."""
        raise NotImplementedError

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` unless it exists; False when it already existed."""
        raise NotImplementedError

    def get(self, path: str) -> bytes:
        """The whole content of ``path`` (FileNotFoundError when absent)."""
        self._count("GET")
        with _translate(self, path, "reading"):
            return bytes(self.fs.cat_file(path))

    def get_or_none(self, path: str) -> bytes | None:
        try:
            return self.get(path)
        except FileNotFoundError:
            return None

    def list(self, folder: str) -> Listing:
        """Files directly inside ``folder``; empty when it does not exist."""
        self._count("LIST")
        try:
            with _translate(self, folder, "listing"):
                entries = self.fs.ls(folder, detail=True)
        except FileNotFoundError:
            return []
        return [
            FileInfo(str(e["name"]).rstrip("/"), int(e.get("size") or 0), _mtime(e))
            for e in entries
            if e.get("type") == "file"
        ]

    def list_recursive(self, folder: str) -> Listing:
        """Every file under ``folder``, at any depth."""
        self._count("LIST")
        try:
            with _translate(self, folder, "listing"):
                found = self.fs.find(folder, detail=True)
        except FileNotFoundError:
            return []
        return [FileInfo(str(p), int(e.get("size") or 0), _mtime(e)) for p, e in found.items()]

    def delete(self, paths: Iterable[str]) -> None:
        """Delete files; a file that is already gone is not an error."""
        todo = list(paths)
        if not todo:
            return
        self._count("DELETE")
        for path in todo:
            with contextlib.suppress(FileNotFoundError), _translate(self, path, "deleting"):
                self.fs.rm_file(path)


class LocalStore(Store):
    """A local folder: atomic writes through a temporary file, fsync and ``os.replace``."""

    def put(self, path: str, data: bytes) -> None:
        self._count("PUT")
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
        self._count("PUT")
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
            self._count("DELETE")
            _remove_quietly(path)


class ObjectStore(Store):
    """An object store (or any non-local fsspec filesystem): every write is one PUT."""

    def put(self, path: str, data: bytes) -> None:
        self._count("PUT")
        with _translate(self, path, "writing"):
            self.fs.pipe_file(path, data)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        self._count("PUT")
        try:
            with _translate(self, path, "creating"):
                self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except OSError as e:
            # S3 answers 409 when another conditional write of the same key is in flight.
            if "ConditionalRequestConflict" in _error_codes(e):
                return False
            raise
        return True

    def delete(self, paths: Iterable[str]) -> None:
        todo = list(paths)
        if not todo:
            return
        self._count("DELETE", (len(todo) + _DELETE_BATCH - 1) // _DELETE_BATCH)
        # A missing file is fine; a missing bucket is not (_translate raises for it first).
        with contextlib.suppress(FileNotFoundError), _translate(self, todo[0], "deleting"):
            self.fs.rm(todo)


class S3Store(ObjectStore):
    """S3 and S3-compatible stores: a read is one GET, a listing or delete one request per
    1,000 keys."""

    def get(self, path: str) -> bytes:
        self._count("GET")
        with _translate(self, path, "reading"):
            # max_concurrency=1: otherwise s3fs sends a HEAD first (to split large downloads),
            # and a HEAD plus a LIST for a file that does not exist.
            return bytes(self.fs.cat_file(path, max_concurrency=1))

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
        with _translate(self, folder, "listing"):
            while True:
                self._count("LIST")
                page = self.fs.call_s3("list_objects_v2", **kwargs)
                found.extend(
                    FileInfo(f"{bucket}/{obj['Key']}", int(obj.get("Size") or 0), _mtime(obj))
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
                with _translate(self, where, "deleting"):
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
                    why = _why_code(code) or "the store refused to delete them"
                    raise StorageError(
                        f"Checkpoint storage error while deleting {len(errors)} file(s) such as "
                        f"{self.display(bucket + '/' + str(first.get('Key')))}: {why} "
                        f"({code}: {first.get('Message', '')}). Stored work is unchanged."
                    )


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """The store for a local path or fsspec URI (``s3://bucket/prefix``, ``gs://...``).

    ``storage_options`` go to the filesystem's constructor (for s3fs: ``key``, ``secret``,
    ``token``, ``endpoint_url``, ``client_kwargs``, ``config_kwargs``...). Without them s3fs
    uses the standard AWS chain: ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``,
    ``AWS_PROFILE``, instance roles. A scheme whose package is not installed fails with a
    ``StorageError`` that names the package.

    Example::

        store = open_store("s3://bucket/checkpoints", {"profile": "analytics"})
    """
    options = dict(storage_options or {})
    protocol, _ = fsspec.core.split_protocol(url)
    if protocol in (None, "file", "local"):
        root = os.path.abspath(os.path.expanduser(fsspec.core.strip_protocol(url)))
        return LocalStore(LocalFileSystem(), root, root)
    # A resume must see what the previous run committed, never a cached listing.
    options["use_listings_cache"] = False
    try:
        fs_cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as e:
        package = _PACKAGES.get(protocol) or _known_package(protocol)
        if package:
            todo = f"Install it (pip install {package}) in the environment that runs the asset."
        else:
            todo = "Check the scheme of the URI, or install the package that provides it."
        raise StorageError(
            f"Cannot open checkpoint storage {url!r}: the filesystem for '{protocol}://' is not "
            f"available ({e}). {todo}"
        ) from e
    if protocol in _S3:
        options.setdefault("cache_regions", False)
        options["config_kwargs"] = merge_options(_S3_CONFIG, options.get("config_kwargs") or {})
    try:
        fs = fs_cls(**options)
    except (TypeError, ValueError, KeyError) as e:
        raise StorageError(
            f"Invalid storage_options for {url!r}: {e}. See the filesystem's documentation "
            f"for the options it takes (for s3://, s3fs.S3FileSystem)."
        ) from e
    root = fs._strip_protocol(url)
    if protocol in _S3:
        fs.retries = _S3FS_RETRIES
        return S3Store(fs, root, f"{protocol}://{root}")
    return ObjectStore(fs, root, f"{protocol}://{root}")


def s3_options(
    *,
    endpoint_url: str | None = None,
    region_name: str | None = None,
    aws_access_key_id: str | None = None,
    aws_secret_access_key: str | None = None,
    aws_session_token: str | None = None,
    profile_name: str | None = None,
    use_ssl: bool = True,
    verify: bool | None = None,
    max_attempts: int | None = None,
    use_unsigned_session: bool = False,
) -> dict[str, Any]:
    """s3fs storage_options from boto-style settings (the fields of dagster-aws's S3Resource).

    Unset values are left out, so the AWS environment chain still fills them in.

    Example::

        s3_options(endpoint_url="http://minio:9000", region_name="us-east-1")
        # {"client_kwargs": {"endpoint_url": "http://minio:9000", "region_name": "us-east-1"}}
    """
    options: dict[str, Any] = {}
    client: dict[str, Any] = {}
    if endpoint_url:
        client["endpoint_url"] = endpoint_url
    if region_name:
        client["region_name"] = region_name
    if verify is not None:
        client["verify"] = verify
    if client:
        options["client_kwargs"] = client
    for name, value in (
        ("key", aws_access_key_id),
        ("secret", aws_secret_access_key),
        ("token", aws_session_token),
        ("profile", profile_name),
    ):
        if value:
            options[name] = value
    if not use_ssl:
        options["use_ssl"] = False
    if use_unsigned_session:
        options["anon"] = True
    if max_attempts is not None:
        options["config_kwargs"] = {"retries": {"max_attempts": max_attempts, "mode": "standard"}}
    return options


def merge_options(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``override``, merging nested dicts (``client_kwargs``) key by key."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_options(out[key], value)
        else:
            out[key] = value
    return out


def _known_package(protocol: str) -> str | None:
    """The package fsspec names for ``protocol`` ("Install s3fs to access S3")."""
    words = str(known_implementations.get(protocol, {}).get("err", "")).split()
    for word, following in itertools.pairwise(words):
        if word.lower() == "install":
            return following
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
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


# -- errors ----------------------------------------------------------------------------------
def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from (s3fs keeps botocore's as the cause)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _error_codes(exc: BaseException) -> set[str]:
    """S3 error codes (``NoSuchBucket``, ``AccessDenied``...) found along the chain."""
    codes = set()
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, Mapping):
            error = response.get("Error") or {}
            if error.get("Code"):
                codes.add(str(error["Code"]))
    return codes


def _why_code(code: str) -> str | None:
    if code == "NoSuchBucket":
        return "the bucket does not exist; create it or fix base_dir"
    if code in _REJECTED:
        return (
            f"the credentials were rejected ({code}): the access key is unknown, the secret "
            "is wrong or the session token expired; check them"
        )
    if code in _DENIED:
        return (
            "access was denied; check the credentials and that their policy allows "
            "s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket on this prefix"
        )
    return None


def _why(store: Store, exc: BaseException) -> str | None:
    """What the user has to fix, or None when ``exc`` is not a storage problem we know."""
    for code in sorted(_error_codes(exc)):
        why = _why_code(code)
        if why:
            return why
    names = {cls.__name__ for e in _chain(exc) for cls in type(e).__mro__}
    text = " ".join(str(e) for e in _chain(exc)).lower()
    if "specified bucket does not exist" in text:
        return _why_code("NoSuchBucket")
    if isinstance(exc, FileNotFoundError):
        return None  # a missing file: the caller decides what that means
    if names & _NO_CREDENTIALS or "unable to locate credentials" in text:
        return (
            "no credentials were found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a "
            "profile or role), pass key and secret in storage_options, or give an S3Resource"
        )
    if "PermissionError" in names or "accessdenied" in text or "forbidden" in text:
        if isinstance(store, LocalStore):
            return "permission denied; check the folder's permissions"
        return _why_code("AccessDenied")
    if names & _UNREACHABLE or "could not connect" in text:
        return (
            "the storage endpoint cannot be reached or does not answer; check the endpoint URL "
            "(endpoint_url, AWS_ENDPOINT_URL_S3) and the network"
        )
    return None


class _translate:
    """Turn a backend's low-level failure into a StorageError that says what to fix.

    A missing file (FileNotFoundError) and an existing one (FileExistsError) pass through for
    the caller to handle, except a missing bucket, which s3fs also reports as FileNotFoundError
    and which must never read as "no checkpoint yet".
    """

    def __init__(self, store: Store, path: str, action: str) -> None:
        self.store = store
        self.path = path
        self.action = action

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> Literal[False]:
        if exc is None or not isinstance(exc, Exception):
            return False
        if isinstance(exc, (FileExistsError, StorageError)):
            return False
        why = _why(self.store, exc)
        if why is None:
            return False
        raise StorageError(
            f"Checkpoint storage error while {self.action} {self.store.display(self.path)}: "
            f"{why} ({type(exc).__name__}: {exc}). Stored work is unchanged."
        ) from exc
