"""The storage layer: one contract (``base.py``), one file per backend (``local.py``,
``objects.py``), errors said as what to fix (``errors.py``), and ``open_store`` (``opening.py``).
"""

from checkpoint_assets.engine.storage.base import FileInfo, Listing, Store
from checkpoint_assets.engine.storage.local import LocalStore
from checkpoint_assets.engine.storage.objects import ObjectStore, S3Store
from checkpoint_assets.engine.storage.opening import merge_options, open_store, s3_options

__all__ = [
    "FileInfo",
    "Listing",
    "LocalStore",
    "ObjectStore",
    "S3Store",
    "Store",
    "merge_options",
    "open_store",
    "s3_options",
]
