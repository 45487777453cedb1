"""Storage failures, said as what the user has to fix.

A backend's low-level failure becomes a ``StorageError`` naming the problem: a missing bucket,
denied access, rejected or missing credentials, an unreachable endpoint. A missing file
(``FileNotFoundError``) and an existing one (``FileExistsError``) pass through for the caller to
handle. A missing bucket is the exception: s3fs also reports it as ``FileNotFoundError``, and it
must never read as "no checkpoint yet". A failed request changes nothing that is stored.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator, Mapping
from typing import Any, Literal, Protocol

from checkpoint_assets.engine.errors import StorageError


class StoreView(Protocol):
    """What the errors say of a store (``base.Store`` has it): whether it is on local disk, and
    a path as the user would paste it."""

    @property
    def local(self) -> bool: ...
    def display(self, path: str) -> str: ...


# S3 error codes, by what the user has to fix.
_DENIED = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "403"}
_REJECTED = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "503"}
_UNAVAILABLE = {"ServiceUnavailable", "InternalError", "500"}
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


def chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from (s3fs keeps botocore's as the cause)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def error_codes(exc: BaseException) -> set[str]:
    """S3 error codes (``NoSuchBucket``, ``AccessDenied``...) found along the chain."""
    codes = set()
    for e in chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, Mapping):
            error = response.get("Error") or {}
            if error.get("Code"):
                codes.add(str(error["Code"]))
    return codes


def why_code(code: str) -> str | None:
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
    if code in _THROTTLED:
        return (
            f"the store kept throttling requests ({code}) after several attempts with back-off; "
            "run again later (it resumes). If it persists, raise min_flush_seconds or "
            "checkpoint_interval, run fewer shards at once under one prefix, or raise "
            "config_kwargs.retries.max_attempts in storage_options"
        )
    if code in _UNAVAILABLE:
        return (
            f"the store kept failing ({code}) after several attempts; run again later: it "
            "resumes from what was stored"
        )
    return None


def _why(store: StoreView, exc: BaseException) -> str | None:
    """What the user has to fix, or None when ``exc`` is not a storage problem we know."""
    for code in sorted(error_codes(exc)):
        why = why_code(code)
        if why:
            return why
    names = {cls.__name__ for e in chain(exc) for cls in type(e).__mro__}
    text = " ".join(str(e) for e in chain(exc)).lower()
    if "specified bucket does not exist" in text:
        return why_code("NoSuchBucket")
    if isinstance(exc, FileNotFoundError):
        return None  # a missing file: the caller decides what that means
    full = {errno.ENOSPC, errno.EDQUOT}
    if any(isinstance(e, OSError) and e.errno in full for e in chain(exc)):
        return (
            "no space left on the device (or the disk quota is used up); free some space or "
            "point base_dir at a larger disk. Then run again: it resumes from what was stored"
        )
    errnos = {getattr(e, "errno", None) for e in chain(exc)}
    if errno.EROFS in errnos:
        return (
            "the file system is read-only; choose a writable base_dir, or mount it read-write "
            "(reading checkpoints from a read-only copy works; running the asset writes)"
        )
    if store.local and (errno.ENOTDIR in errnos or "NotADirectoryError" in names):
        return "a part of the path is a file, not a folder; point base_dir at a folder"
    if names & _NO_CREDENTIALS or "unable to locate credentials" in text:
        return (
            "no credentials were found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a "
            "profile or role), pass key and secret in storage_options, or give an S3Resource"
        )
    if "PermissionError" in names or "accessdenied" in text or "forbidden" in text:
        if store.local:
            return (
                f"permission denied to this process (uid {os.getuid()}); give it write access "
                "to base_dir, or choose a base_dir it can write"
            )
        return why_code("AccessDenied")
    if names & _UNREACHABLE or "could not connect" in text:
        return (
            "the storage endpoint cannot be reached or does not answer; check the endpoint URL "
            "(endpoint_url, AWS_ENDPOINT_URL_S3) and the network"
        )
    return None


class translate:
    """Turn a backend's low-level failure into a StorageError that says what to fix.

    A missing file (FileNotFoundError) and an existing one (FileExistsError) pass through for
    the caller to handle. A missing bucket is the exception: s3fs also reports it as
    FileNotFoundError, and it must never read as "no checkpoint yet".
    """

    def __init__(self, store: StoreView, path: str, action: str) -> None:
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


def refused(store: StoreView, path: str, exc: OSError, action: str) -> StorageError:
    """The error for a file or folder the operating system would not create, while ``action``
    ``path``: the path, the OS's reason, and what to do. A missing parent that cannot be made is
    said as such, not as a missing file. (Under ``/proc`` the OS answers ENOENT, under ``/sys``
    EPERM, even to root.)
    """
    why = _why(store, exc)
    if why is None:
        failed = str(exc.filename or path)
        what = f"the folder {failed}" if action == "creating the folder" else "a file"
        why = (
            f"the operating system refused to create {what} in {_nearest_existing(failed)}, "
            "which exists but takes nothing new (a virtual file system such as /proc or /sys). "
            "Point base_dir at a folder on a writable disk"
        )
    reason = errno.errorcode.get(exc.errno or 0, "")
    said = f"{type(exc).__name__}: {reason + ' ' if reason else ''}{exc.strerror or exc}"
    return StorageError(
        f"Checkpoint storage error while {action} {store.display(path)}: {why} ({said}). "
        "Stored work is unchanged."
    )


def _nearest_existing(path: str) -> str:
    """The nearest folder at or above ``path`` that exists."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path
