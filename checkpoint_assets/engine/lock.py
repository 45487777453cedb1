"""One writer per checkpoint: a lease in ``<name>.parquet.lock``.

The lock file is created with a conditional create (``O_EXCL``-like link locally, ``If-None-Match``
on S3), never check-then-write. It names its holder (run id, host, pid, since) and carries a lease
that a heartbeat thread renews. A second writer fails at once with the holder named, unless the
holder is dead: a pid gone on this host, a lease that expired, or a run the caller knows finished
(``is_run_finished``, which the Dagster layer answers from the instance). A dead holder's lock is
taken over with a warning.

A holder whose process was paused past its lease (a suspended laptop or VM) may find, on waking,
that another writer took the lock over. Its heartbeat then leaves the new holder's lock alone and
marks the lease lost, and the run stops at its next flush without writing anything more.

A lock file that cannot be read as a lease (garbage: our own writes are atomic, so something else
wrote it) never lets two writers in: it counts as held by an unknown holder whose lease ends
``lease_seconds`` after the file was last written (its modification time), and is taken over
after that, with a warning; a live holder whose lock file turned to garbage finds on its next
renewal that it is no longer its own and stops, like a holder whose lock was taken over.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from checkpoint_assets.engine.errors import LockHeldError
from checkpoint_assets.engine.settings import DEFAULT_LEASE_SECONDS
from checkpoint_assets.engine.storage import Store

Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as written in the lock file."""

    token: str
    run_id: str | None
    host: str
    pid: int
    since: float
    expires: float

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        if self.token == UNREADABLE:
            return f"an unknown writer (the lock file is unreadable; last written {since})"
        run = f"run {self.run_id}, " if self.run_id else ""
        return f"{run}host {self.host}, pid {self.pid}, since {since}"


UNREADABLE = "?"  # the token of a holder whose lock file is garbage


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """The lock of one checkpoint, held from ``acquire()`` to ``release()``."""

    def __init__(
        self,
        store: Store,
        path: str,
        *,
        run_id: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        is_run_finished: Callable[[str], bool] | None = None,
        logger: Logger | None = None,
    ) -> None:
        self.store = store
        self.log: Logger = logger or logging.getLogger("checkpoint_assets")
        self.path = path
        self.run_id = run_id
        self.lease_seconds = lease_seconds
        self.is_run_finished = is_run_finished
        self.holder: Holder | None = None
        self.lost: str | None = None  # why this writer no longer holds the lock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _new_holder(self, since: float | None = None) -> Holder:
        now = time.time()
        return Holder(
            token=self.holder.token if self.holder else uuid.uuid4().hex,
            run_id=self.run_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            since=since if since is not None else now,
            expires=now + self.lease_seconds,
        )

    def read(self) -> Holder | None:
        data = self.store.get_or_none(self.path)
        if data is None:
            return None
        holder = _decode(data)
        if holder is not None:
            return holder
        # Garbage: held by an unknown writer until a lease has passed since it was written.
        folder = self.path.rsplit("/", 1)[0]
        found = [f for f in self.store.list(folder) if f.path == self.path]
        if not found:
            return None  # deleted meanwhile
        written = found[0].mtime if found[0].mtime is not None else time.time()
        return Holder(UNREADABLE, None, "?", -1, written, written + self.lease_seconds)

    def dead_reason(self, holder: Holder) -> str | None:
        """Why ``holder`` is dead (its lock may be taken over), or None while it lives."""
        if holder.expires < time.time():
            return "its lease expired"
        if holder.host == socket.gethostname() and not _pid_alive(holder.pid):
            return f"process {holder.pid} is gone"
        if holder.run_id and self.is_run_finished and self.is_run_finished(holder.run_id):
            return f"its run {holder.run_id} has finished"
        return None

    def acquire(self) -> None:
        """Take the lock or raise ``LockHeldError`` naming the live holder."""
        for _ in range(3):
            mine = self._new_holder()
            if self.store.put_if_absent(self.path, _encode(mine)):
                self.holder = mine
                self._start_heartbeat()
                return
            current = self.read()
            if current is None:
                continue  # released between our attempt and the read: try again
            reason = self.dead_reason(current)
            if reason is None:
                remedy = (
                    "Wait for it to finish, or terminate that run; a lock of a dead holder is "
                    "taken over automatically."
                )
                if current.token == UNREADABLE:
                    until = datetime.fromtimestamp(current.expires, UTC)
                    remedy = (
                        "It is taken over automatically after "
                        f"{until:%Y-%m-%d %H:%M:%S} UTC, a lease after it was written; if you "
                        "know no run writes this checkpoint, delete the lock file to go on now."
                    )
                error = LockHeldError(
                    f"Checkpoint {self.store.display(self.path)} is being written by another "
                    f"writer ({current.describe()}).",
                    remedy,
                )
                error.holder = current.describe()
                raise error
            self.log.warning(
                "Taking over the checkpoint lock %s from %s: %s.",
                self.store.display(self.path),
                current.describe(),
                reason,
            )
            self.store.delete([self.path])
        raise LockHeldError(
            f"Could not take the lock {self.store.display(self.path)}: other writers keep "
            "racing for it.",
            "Make sure one run writes each checkpoint.",
        )

    def renew(self) -> None:
        """Extend the lease (the heartbeat calls it), unless another writer took the lock over."""
        if self.holder is None or self.lost is not None:
            return
        current = self.read()
        if current is None or current.token != self.holder.token:
            taker = (
                f"another writer ({current.describe()})" if current else "someone who deleted it"
            )
            self.lost = (
                f"The lock {self.store.display(self.path)} was taken over by {taker} while this "
                "run held it: the run was probably paused for longer than its "
                f"{self.lease_seconds:.0f} s lease. It stops without writing anything more; what "
                "it flushed before is kept. Run it again once the other writer is done: it resumes."
            )
            self.log.error("%s", self.lost)
            return
        self.holder = self._new_holder(since=self.holder.since)
        self.store.put(self.path, _encode(self.holder))

    def check(self) -> None:
        """Raise ``LockHeldError`` if the lock was taken over (see ``renew``)."""
        if self.lost is not None:
            raise LockHeldError(self.lost)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.holder is None:
            return
        current = self.read()
        if current is not None and current.token == self.holder.token:
            self.store.delete([self.path])
        self.holder = None

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        interval = max(self.lease_seconds / 3.0, 0.05)

        def beat() -> None:
            while not self._stop.wait(interval):
                try:
                    self.renew()
                except Exception as e:  # a failed renewal must not kill the run
                    self.log.warning("Could not renew the checkpoint lock: %s", e)

        self._thread = threading.Thread(target=beat, name="checkpoint-lease", daemon=True)
        self._thread.start()


def _encode(holder: Holder) -> bytes:
    return json.dumps(asdict(holder)).encode()


def _decode(data: bytes) -> Holder | None:
    """The holder a lock file names; None when it is not a lease this package wrote."""
    try:
        raw = json.loads(data)
        holder = Holder(**raw)
    except (ValueError, TypeError):
        return None
    numbers = (holder.pid, holder.since, holder.expires)
    texts = (holder.token, holder.host)
    if not all(isinstance(n, int | float) and not isinstance(n, bool) for n in numbers):
        return None
    if not all(isinstance(t, str) for t in texts) or holder.token == UNREADABLE:
        return None
    if holder.run_id is not None and not isinstance(holder.run_id, str):
        return None
    return holder
