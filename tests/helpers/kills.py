"""What the kill tests' child processes share (``kill_child.py``, ``provider_kill_child.py``,
``reparse_kill_child.py``): dying on the spot, and the request and parse of a request/parse job
on the chat format of the local batch provider."""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def die() -> None:
    """SIGKILL this process: no handler, no flush, no cleanup."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)  # never reached: SIGKILL is not deliverable later than now


def request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


def parse(body: dict[str, Any]) -> dict[str, Any]:
    return {"answer": body["choices"][0]["message"]["content"]}
