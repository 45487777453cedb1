"""How many processes of this machine call one key now: a file each in a directory of the key.

For limits the user states (``requests_per_minute``, ``tokens_per_minute``), each process that
calls the key takes an equal share. For limits the endpoint states, each file holds the shares
of the key's draw its process measured; each process takes their mean (``pacing.py``). A
process rewrites its file while it sends requests or they wait, at most every
``INTERVAL_SECONDS`` (every ``FIRST_INTERVAL_SECONDS`` while it starts), and counts the files
written in the last ``LIVE_SECONDS``. So the shares grow when shards finish and shrink when
more start, with no coordination service. A process leaving removes its file; the file of one
that was killed stops counting after ``LIVE_SECONDS`` and is removed later.

A process that joins sends nothing for ``JOIN_SECONDS`` after it first counts. The others
count it in that time and take their smaller shares. Otherwise, while shards start seconds
apart, the early ones would still take the larger shares of fewer peers, and the key would be
overdrawn.

The directory is ``checkpoint-assets-keys/<digest of the URL and key>`` under the system's
temporary directory: it holds no key. Processes on other machines are not seen; for those, set
the resource's ``shards_at_once``.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

INTERVAL_SECONDS: Final = 0.5
JOIN_SECONDS: Final = 1.5  # a joining process's wait: the others' interval and a request's gap
FIRST_INTERVAL_SECONDS: Final = 0.1  # while the process starts: shards often start together
FIRST_SECONDS: Final = 2.0
LIVE_SECONDS: Final = 3.0  # a file touched this recently is a process calling the key
FORGET_SECONDS: Final = 600.0  # a file left this long (a killed process) is removed


def directory_of(identity: str, root: Path | None = None) -> Path:
    """The directory of the key named by ``identity`` (its URL and key)."""
    digest = hashlib.sha256(identity.encode()).hexdigest()[:20]
    return (root or Path(tempfile.gettempdir()) / "checkpoint-assets-keys") / digest


class Peers:
    """This process's file in the key's directory, and the count of those calling the key."""

    def __init__(
        self, directory: Path, name: str | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.directory = directory
        self.clock = clock
        self.mine = directory / (name or f"{os.getpid()}")
        self._began: float | None = None
        self._next = -float("inf")
        self.count = 1
        self.joined = False  # the last poll was this process's first
        self.shares: dict[str, list[float]] = {}  # what the live processes measured, by budget
        self._polling = threading.Lock()

    def poll(self, measured: Callable[[], Mapping[str, float]] = dict) -> int | None:
        """The processes calling the key now, this one included, when due to count again
        (None when not). This process's file is written first, with the shares of the key's
        draw it ``measured`` (by budget); :attr:`shares` then holds those of every process.
        While one thread polls, the others get None: its count serves them all."""
        if not self._polling.acquire(blocking=False):
            return None
        try:
            return self._poll(measured)
        finally:
            self._polling.release()

    def _poll(self, measured: Callable[[], Mapping[str, float]]) -> int | None:
        now = self.clock()
        if now < self._next:
            return None
        self.joined = self._began is None
        if self._began is None:
            self._began = now
            self.directory.mkdir(parents=True, exist_ok=True)
            atexit.register(self.leave)
        first = now - self._began < FIRST_SECONDS
        self._next = now + (FIRST_INTERVAL_SECONDS if first else INTERVAL_SECONDS)
        # Written aside, then renamed over the file: a reader sees the old shares or the new.
        aside = self.directory / f".{self.mine.name}"
        aside.write_text("".join(f"{kind} {share:.6f}\n" for kind, share in measured().items()))
        os.utime(aside, (now, now))
        os.replace(aside, self.mine)
        count = 0
        self.shares = {}
        for entry in os.scandir(self.directory):
            if not entry.name.startswith(".") and self._live(entry, now):
                count += 1
                self._read(entry.path)
        self.count = max(1, count)
        return self.count

    def _live(self, entry: os.DirEntry[str], now: float) -> bool:
        try:
            age = now - entry.stat().st_mtime
            if age > FORGET_SECONDS:
                os.unlink(entry.path)
        except FileNotFoundError:  # another process removed it
            return False
        return age <= LIVE_SECONDS

    def _read(self, path: str) -> None:
        try:
            with open(path, "rb") as file:
                text = file.read(4096).decode(errors="replace")
        except FileNotFoundError:  # the process left
            return
        for line in text.splitlines():
            kind, _, value = line.partition(" ")
            try:
                self.shares.setdefault(kind, []).append(float(value))
            except ValueError:  # not a share: not this package's file
                continue

    def leave(self) -> None:
        """Remove this process's file: it calls the key no more."""
        self.mine.unlink(missing_ok=True)
