"""Child process: take a checkpoint's lock, say so, and hold it until stdin closes.

Usage: ``python hold_lock.py BASE_DIR OPTIONS_JSON LOCK_NAME RUN_ID``
"""

from __future__ import annotations

import json
import sys

from checkpoint_assets.engine.loop.lock import Lease
from checkpoint_assets.engine.storage import open_store


def main() -> None:
    base_dir, options, name, run_id = sys.argv[1:5]
    store = open_store(base_dir, json.loads(options))
    lease = Lease(store, store.path(name), run_id=run_id, lease_seconds=60.0)
    lease.acquire()
    print("held", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    lease.release()


if __name__ == "__main__":
    main()
