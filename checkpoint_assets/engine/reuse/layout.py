"""Where the result store keeps results, and the columns that key them.

Under the store's root (by default ``result-store`` beside the checkpoints)::

    <scope>/<bucket>/<written at, ms>-<uuid>.parquet

- ``<scope>``: 32 hex digits of BLAKE3 over the function's fingerprint and the job settings that
  change results (``scope``). A changed function or setting has another scope: it misses.
- ``<bucket>``: the top ``BUCKET_BITS`` bits of the content key, two hex digits.
- a file: immutable, written once under a unique name, never rewritten. It holds ``KEY_HI``,
  ``KEY_LO``, ``ID_KEY`` (the shard key of the id whose run computed the row: ``hashing.py``'s
  ``shard_key``) and the output columns, sorted by ``ID_KEY``, in row groups of
  ``ROW_GROUP_ROWS`` with statistics. Its name starts with when it was written (milliseconds
  since the epoch).

Keys are stored as signed 64-bit integers: the unsigned half with its top bit flipped, ordered
as the unsigned value, within the integers every Parquet reader compares.
"""

from __future__ import annotations

import posixpath
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

import polars as pl

from checkpoint_assets.engine.sharding import hashing

FOLDER = "result-store"  # the store's folder under a checkpoint root, by default
BUCKET_BITS = 8
ROW_GROUP_ROWS = 2048
KEY_HI = "_key_hi"
KEY_LO = "_key_lo"
KEYS = (KEY_HI, KEY_LO)
ID_KEY = "_id_key"
# The job settings that say where results are kept, not what they are: left out of the scope.
PLACE = ("asset", "id_column")
_FILE = re.compile(r"^(\d{13})-[0-9a-f]{12}\.parquet$")


def scope(function: Mapping[str, str], job: Mapping[str, Any]) -> str:
    """The scope of results of ``function`` (its fingerprint) under ``job``'s settings."""
    settings = {k: v for k, v in job.items() if k not in PLACE}
    return hashing.job_fingerprint({"function": dict(function), "job": settings})


def stored_keys(hi: str, lo: str) -> list[pl.Expr]:
    """The content key columns ``hi`` and ``lo`` (UInt64) as stored (``KEY_HI``, ``KEY_LO``)."""
    flip = pl.lit(1 << 63, pl.UInt64)
    return [
        (pl.col(hi) ^ flip).reinterpret(signed=True).alias(KEY_HI),
        (pl.col(lo) ^ flip).reinterpret(signed=True).alias(KEY_LO),
    ]


def id_key(id_column: str, dtype: pl.DataType) -> pl.Expr:
    """``ID_KEY`` of each (canonical) id in ``id_column``: where its shard finds it."""
    return hashing.shard_key(id_column, dtype).alias(ID_KEY)


def bucket() -> pl.Expr:
    """The bucket of each stored key (``KEY_HI``), 0 to ``2**BUCKET_BITS - 1``."""
    flipped = pl.col(KEY_HI).reinterpret(signed=False) ^ pl.lit(1 << 63, pl.UInt64)
    return flipped.floordiv(1 << (64 - BUCKET_BITS)).cast(pl.Int32)


def bucket_name(index: int) -> str:
    return f"{index:0{(BUCKET_BITS + 3) // 4}x}"


def bucket_of(path: str) -> int | None:
    """The bucket of a stored file's path, or None for a path that is no result file."""
    if _FILE.match(posixpath.basename(path)) is None:
        return None
    try:
        return int(posixpath.basename(posixpath.dirname(path)), 16)
    except ValueError:
        return None


def new_file(root: str, scope_name: str, index: int, when: float | None = None) -> str:
    """A new, unique file of bucket ``index`` written at ``when`` (now by default)."""
    ms = int((time.time() if when is None else when) * 1000)
    name = f"{ms:013d}-{uuid.uuid4().hex[:12]}.parquet"
    return posixpath.join(root, scope_name, bucket_name(index), name)


def written_at(path: str) -> float | None:
    """When a result file was written (seconds since the epoch), from its name."""
    found = _FILE.match(posixpath.basename(path))
    return int(found[1]) / 1000 if found else None


def scope_of(path: str, root: str) -> str:
    """The scope folder of a result file under ``root``."""
    return posixpath.relpath(path, root).split("/")[0]
