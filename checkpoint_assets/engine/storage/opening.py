"""Opening a store for a local path or fsspec URI, and the options that reach the filesystem."""

from __future__ import annotations

import inspect
import itertools
import os
import urllib.parse
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations

from checkpoint_assets.engine.errors import StorageError
from checkpoint_assets.engine.storage.base import Store
from checkpoint_assets.engine.storage.local import LocalStore
from checkpoint_assets.engine.storage.objects import ObjectStore, S3Store

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
_GCS = ("gs", "gcs")

# botocore settings for s3fs unless ``config_kwargs`` in storage_options says otherwise:
# "standard" retries (throttling, 5xx, dropped connections) with at most 3 attempts.
_S3_CONFIG: dict[str, Any] = {
    "connect_timeout": 5,
    "retries": {"max_attempts": 3, "mode": "standard"},
}
# s3fs retries a failed call again on top of botocore; once more is enough (it covers a body
# that broke off while being read, which botocore does not retry).
_S3FS_RETRIES = 2


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """The store for a local path or fsspec URI (``s3://bucket/prefix``, ``gs://...``,
    ``az://container/prefix``).

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
        if os.path.exists(root) and not os.path.isdir(root):
            raise StorageError(
                f"Cannot open checkpoint storage {url!r}: {root} is a file, not a folder.",
                "Point base_dir at a folder (it is created if missing), or move the file away.",
            )
        return LocalStore(LocalFileSystem(), root, root)
    _refuse_credentials_in(url, options)
    # A resume must see what the previous run committed, never a cached listing.
    options["use_listings_cache"] = False
    try:
        fs_cls = _filesystem_class(protocol)
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
        _refuse_unknown_options(fs_cls, options, url)
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


def _filesystem_class(protocol: str) -> type[fsspec.AbstractFileSystem]:
    """fsspec's filesystem for ``protocol``; for GCS, gcsfs's JSON-API one.

    gcsfs's default class (its "extended" one) first asks the Storage Control API, over gRPC,
    for the bucket's layout. While it cannot tell, it asks again before each operation; that
    happens without that permission, or on an emulator. In zonal buckets it writes without the
    ``ifGenerationMatch=0`` precondition that the lock's conditional create needs. The JSON-API
    class makes every operation one HTTP request and sends the precondition.
    """
    if protocol in _GCS:
        from gcsfs.core import GCSFileSystem

        return GCSFileSystem  # type: ignore[no-any-return]
    return fsspec.get_filesystem_class(protocol)  # type: ignore[no-any-return]


# Options every fsspec filesystem takes besides its own (AbstractFileSystem, AsyncFileSystem).
_FSSPEC_OPTIONS = frozenset(
    {
        "asynchronous",
        "loop",
        "batch_size",
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
    }
)


def _refuse_credentials_in(url: str, options: Mapping[str, Any]) -> None:
    """Credentials written into a URI (``s3://KEY:SECRET@bucket``, an endpoint with
    ``user:password@``) would show in paths, messages and logs: refuse them, without repeating
    them."""
    parts = urllib.parse.urlsplit(url)
    if "@" in parts.netloc:
        shown = f"{parts.scheme}://***@{parts.netloc.rsplit('@', 1)[1]}{parts.path}"
        raise StorageError(
            f"Cannot open checkpoint storage {shown}: the URI carries credentials "
            "(user:password@).",
            "Give them in storage_options (key and secret for s3://) or through the environment "
            "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), never inside base_dir.",
        )
    client = options.get("client_kwargs") or {}
    for endpoint in (options.get("endpoint_url"), client.get("endpoint_url")):
        if isinstance(endpoint, str) and "@" in urllib.parse.urlsplit(endpoint).netloc:
            raise StorageError(
                "Cannot open checkpoint storage: the endpoint_url in storage_options carries "
                "credentials (user:password@).",
                "Give the endpoint without them, and the credentials as key and secret in "
                "storage_options or through the environment.",
            )


def _refuse_unknown_options(fs_cls: type, options: Mapping[str, Any], url: str) -> None:
    """s3fs takes any keyword and fails only at the first request: name unknown ones now.

    Its own keywords, fsspec's, and aiobotocore's session keywords (``profile``...), which s3fs
    passes on, are known.
    """
    try:
        from aiobotocore.session import AioSession

        own = inspect.signature(getattr(fs_cls, "__init__")).parameters  # noqa: B009
        session = inspect.signature(AioSession.__init__).parameters
    except (ImportError, TypeError, ValueError):
        return
    known = {p for p in [*own, *session] if p not in ("self", "args", "kwargs")}
    known |= _FSSPEC_OPTIONS
    unknown = sorted(set(options) - known)
    if unknown:
        raise StorageError(
            f"Invalid storage_options for {url!r}: unknown option(s) {unknown} (it takes "
            f"{sorted(known - _FSSPEC_OPTIONS)}).",
            "Fix their names; see s3fs.S3FileSystem for what each one does.",
        )


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
