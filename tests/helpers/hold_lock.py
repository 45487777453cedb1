"""Child process: take a checkpoint's lock, say so, and hold it until stdin closes.

Usage: ``python hold_lock.py BASE_DIR OPTIONS_JSON LOCK_NAME RUN_ID``; a test starts one with
``hold`` and ends it with ``end``.
"""

from __future__ import annotations

import json
import subprocess
import sys

from checkpoint_assets.engine.loop.lock import Lease
from checkpoint_assets.engine.storage import open_store


def hold(
    base_dir: str, options: dict[str, object], name: str, run_id: str
) -> subprocess.Popen[str]:
    """A child process holding the lock ``name`` as run ``run_id``, once it holds it."""
    child = subprocess.Popen(
        [sys.executable, __file__, base_dir, json.dumps(options), name, run_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


def end(child: subprocess.Popen[str]) -> None:
    """End a child of ``hold``: it releases the lock and exits."""
    # Closing stdin ends the child; closing stdout too leaves no pipe for the collector.
    for pipe in (child.stdin, child.stdout):
        if pipe is not None:
            pipe.close()
    child.wait(timeout=30)


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
