"""A result file's key filter: which of its row groups may hold a content key.

Each row group has one section: the ``FINGERPRINT_BITS`` bits of its keys' ``KEY_HI`` that follow
the bucket's bits, sorted, as deltas, the four bytes of each delta in planes, compressed with
zstd. The key is already a uniform hash, so these bits are its fingerprint: no hashing. A key
whose fingerprint is not in a section is not in that row group. One that is may be (a false
positive, about ``keys in its bucket / 2**32`` a key): its row group's key columns decide.

Why not a Bloom filter of 10 bits a key: it says "maybe" for 1 % of the keys asked, in each row
group asked. 625,000 new keys asking a bucket of 19 row groups would read every row group. Over a
bucket of 39,000 keys, 32-bit fingerprints say "maybe" for about one key in 100,000.

The sections sit between the file's last column chunk and its footer. Nothing in the footer
points there, so Parquet readers never look; the footer's key-value metadata ``FILTER_KEY``
holds their lengths (JSON). The file and its filter are written at once. A lookup reads the
sections of a run of row groups in one ranged GET. A file without ``FILTER_KEY`` has every row
group's key columns read.
"""

from __future__ import annotations

import itertools
import json
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from checkpoint_assets.engine.reuse.layout import BUCKET_BITS

FILTER_KEY = "checkpoint_assets.key_filter"
FINGERPRINT_BITS = 32
_FLIP = np.uint64(1 << 63)


def fingerprints(key_hi: np.ndarray) -> np.ndarray:
    """The fingerprint (uint32) of each stored ``KEY_HI`` (int64): the bits after the bucket's."""
    unsigned = key_hi.astype(np.int64).view(np.uint64) ^ _FLIP
    return ((unsigned << np.uint64(BUCKET_BITS)) >> np.uint64(64 - FINGERPRINT_BITS)).astype(
        np.uint32
    )


def section(key_hi: np.ndarray) -> bytes:
    """The section of a row group whose keys' ``KEY_HI`` are ``key_hi``."""
    ordered = np.sort(fingerprints(key_hi))
    deltas = np.diff(ordered, prepend=np.uint32(0)).astype("<u4")
    planes = deltas.view(np.uint8).reshape(-1, 4).T.tobytes()
    return bytes(pa.compress(planes, codec="zstd", asbytes=True))


def read_section(data: bytes, rows: int) -> np.ndarray:
    """The sorted fingerprints of a row group of ``rows`` rows, from its section ``data``."""
    planes = pa.decompress(data, decompressed_size=4 * rows, codec="zstd", asbytes=True)
    deltas = np.frombuffer(planes, np.uint8).reshape(4, rows).T.copy().view("<u4").ravel()
    return np.cumsum(deltas, dtype=np.uint64).astype(np.uint32)


def may_hold(ordered: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Which fingerprints of ``wanted`` are among ``ordered`` (sorted)."""
    if not ordered.size:
        return np.zeros(wanted.size, bool)
    at = np.minimum(np.searchsorted(ordered, wanted), ordered.size - 1)
    held: np.ndarray = ordered[at] == wanted
    return held


def with_filter(parquet: bytes, sections: list[bytes]) -> bytes:
    """``parquet`` (written with ``metadata(sections)``) with ``sections`` before its footer."""
    (length,) = struct.unpack("<I", parquet[-8:-4])
    cut = len(parquet) - 8 - length
    return parquet[:cut] + b"".join(sections) + parquet[cut:]


def metadata(sections: list[bytes]) -> dict[str, str]:
    """The key-value metadata that says where ``sections`` are."""
    return {FILTER_KEY: json.dumps([len(s) for s in sections])}


def spans(meta: pq.FileMetaData, size: int, footer: int) -> list[tuple[int, int]] | None:
    """Each row group's section as (start, end) in a file of ``size`` bytes whose footer is
    ``footer`` bytes long; None for a file without a filter, or one whose lengths do not fit."""
    found = (meta.metadata or {}).get(FILTER_KEY.encode())
    if found is None:
        return None
    try:
        lengths = [int(n) for n in json.loads(found)]
    except (ValueError, TypeError):
        return None
    start = size - 8 - footer - sum(lengths)
    if len(lengths) != meta.num_row_groups or min(lengths, default=0) < 0 or start < 4:
        return None
    return list(itertools.pairwise(np.cumsum([start, *lengths]).tolist()))
