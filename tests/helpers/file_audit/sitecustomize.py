"""Records which files each process touches, for the daemon-path tests.

Python imports ``sitecustomize`` at start-up from the first folder on its path that has one: with
this folder first on ``PYTHONPATH``, every process the test's `dagster dev` starts (code server,
runs) installs an audit hook (``sys.addaudithook``). The hook writes one line per file opened
(read or write), renamed, linked or removed under ``$FILE_AUDIT_ROOT``, as
``<seconds> <event> <path>``, to ``$FILE_AUDIT_LOG.<pid>``. Without those variables it does
nothing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

_ROOT = os.environ.get("FILE_AUDIT_ROOT")
_LOG = os.environ.get("FILE_AUDIT_LOG")
_PATH_ARGS = {"open": 1, "os.rename": 2, "os.link": 2, "os.remove": 1}
_inside = threading.local()


def _hook(event: str, args: tuple[Any, ...]) -> None:
    count = _PATH_ARGS.get(event)
    if count is None or getattr(_inside, "busy", False):
        return
    paths = []
    for arg in args[:count]:
        if isinstance(arg, str | bytes | os.PathLike):
            path = os.fsdecode(arg)
            if _ROOT and path.startswith(_ROOT):
                paths.append(path)
    if not paths:
        return
    _inside.busy = True  # the log's own open() comes through here too
    try:
        with open(f"{_LOG}.{os.getpid()}", "a") as log:
            log.writelines(f"{time.time():.3f} {event} {path}\n" for path in paths)
    finally:
        _inside.busy = False


if _ROOT and _LOG:
    sys.addaudithook(_hook)
