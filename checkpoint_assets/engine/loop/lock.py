"""One writer per checkpoint: a lease in ``<name>.parquet.lock``.

The lock file is created with a conditional create (``O_EXCL``-like link locally, ``If-None-Match``
on S3), never check-then-write. It names its holder: run id, host, pid, the pid of the process
that launched it, since. It carries a lease that a heartbeat thread renews every third of
``lease_seconds``.

A second writer fails at once with ``LockHeldError`` naming the holder, unless the holder is
dead. Only evidence that cannot be wrong while the holder lives counts:

- its lease expired (it stopped renewing);
- its pid is gone on this host.

A run that the caller reports over is no such evidence: a live process may still renew its lease
and write. A dead holder's lock is taken over with a warning. The taker checks half a second
later that no other taker replaced its lock. The caller's ``RunWatch`` hears of the dead holder
(the Dagster layer reports its run failed).

A holder trusts its lease only until a tenth of it before it expires, by its own clock. The
tenth covers clocks that disagree and the request in flight. Past that, or once its heartbeat
finds the lock taken over, it has lost the lock. It starts no more calls at once, and writes,
compacts or deletes nothing more. It leaves the lock file alone, even its own expired one. Every
write of a writer checks this first (``check``). A pause that lands between that check and the
request itself is the one window left: storage offers no fencing token.

A ``RunWatch`` also tells the heartbeat when this process should stop although it holds the
lock: its run is over, or the process that launched it is gone. The process then starts no more
calls, keeps what is done and releases the lock (``stopped``). A writer that finds the lock held
by a live holder whose run is over waits up to ``STOP_WAIT_SECONDS`` for it to stop itself.

A lock file that cannot be read as a lease is garbage: our own writes are atomic, so something
else wrote it. It never lets two writers in. It counts as held by an unknown holder whose lease
ends ``lease_seconds`` after the file was last written (its modification time). After that it is
taken over, with a warning. A live holder whose lock file turned to garbage finds on its next
renewal that the lock is no longer its own. It stops, like a holder whose lock was taken over.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Protocol

from checkpoint_assets.engine.errors import LockHeldError
from checkpoint_assets.engine.settings import DEFAULT_LEASE_SECONDS
from checkpoint_assets.engine.storage import Store

Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]

WATCH_SECONDS = 2.0  # how often the heartbeat asks the RunWatch whether to stop
STOP_WAIT_SECONDS = 30.0  # how long a writer waits for a live holder whose run is over
TAKEOVER_SETTLE_SECONDS = 0.5  # a taker checks after this that no racing taker replaced it
TRUSTED = 0.9  # the share of its lease a holder trusts: writes stop a tenth before it expires


def wall_clock() -> float:
    """The clock leases are written in: seconds since the epoch. A lease made without a clock
    reads this function when it is made, so a test can put a later clock in its place."""
    return time.time()


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as written in the lock file."""

    token: str
    run_id: str | None
    host: str
    pid: int
    since: float
    expires: float
    launcher: int | None = None  # the process that started the holder's, when it has one

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        if self.token == UNREADABLE:
            return f"an unknown writer (the lock file is unreadable; last written {since})"
        run = f"run {self.run_id}, " if self.run_id else ""
        return f"{run}host {self.host}, pid {self.pid}, since {since}"

    @property
    def local(self) -> bool:
        """Whether the holder runs on this host."""
        return self.host == socket.gethostname()


UNREADABLE = "?"  # the token of a holder whose lock file is garbage


class RunWatch(Protocol):
    """What a lease asks the layer that runs it about runs (Dagster's instance, for assets)."""

    def stop_reason(self) -> str | None:
        """Why this process should stop although it holds the lock (its run is over, the
        process that launched it is gone), or None while it should go on."""

    def run_over(self, run_id: str) -> str | None:
        """How the run ``run_id`` ended (``failed``, ``canceled``...), or None while it runs."""

    def holder_died(self, holder: Holder, reason: str) -> None:
        """The lock of ``holder``, dead for ``reason``, was taken over by this process."""


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, exited but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (macOS): kill's answer stands
    return state != b"Z"


def launcher_pid() -> int | None:
    """The process that started this one through ``multiprocessing`` (a Dagster step's run
    worker, or the ``dagster asset materialize`` that spawned it); None for any other."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None else None


class Lease:
    """The lock of one checkpoint, held from ``acquire()`` to ``release()``.

    ``watch``: what the heartbeat asks about runs (see ``RunWatch``); ``clock``: the wall
    clock that leases are written in (default: ``wall_clock``).
    """

    def __init__(
        self,
        store: Store,
        path: str,
        *,
        run_id: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        watch: RunWatch | None = None,
        logger: Logger | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.store = store
        self.log: Logger = logger or logging.getLogger("checkpoint_assets")
        self.path = path
        self.run_id = run_id
        self.lease_seconds = lease_seconds
        self.watch = watch
        self.clock = clock or wall_clock
        self.holder: Holder | None = None
        self.lost: str | None = None  # why this writer no longer holds the lock
        self.stopped: str | None = None  # why this writer should stop although it holds it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _new_holder(self, since: float | None = None) -> Holder:
        now = self.clock()
        return Holder(
            token=self.holder.token if self.holder else uuid.uuid4().hex,
            run_id=self.run_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            since=since if since is not None else now,
            expires=now + self.lease_seconds,
            launcher=launcher_pid(),
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
        written = found[0].mtime if found[0].mtime is not None else self.clock()
        return Holder(UNREADABLE, None, "?", -1, written, written + self.lease_seconds)

    def dead_reason(self, holder: Holder) -> str | None:
        """Why ``holder`` is dead (its lock may be taken over), or None while it may live."""
        if holder.expires < self.clock():
            return "its lease expired"
        if holder.local and not pid_alive(holder.pid):
            return f"process {holder.pid} is gone"
        return None

    # -- taking the lock -----------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lock or raise ``LockHeldError`` naming the live holder."""
        waited = False
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
            if reason is None and not waited:
                waited = True
                current = self._wait_for_stop(current)
                if current is None:
                    continue  # it stopped and released the lock
                reason = self.dead_reason(current)
            if reason is None:
                raise self._held(current)
            self.log.warning(
                "Taking over the checkpoint lock %s from %s: %s.",
                self.store.display(self.path),
                current.describe(),
                reason,
            )
            self.store.delete([self.path])
            mine = self._new_holder()
            if self.store.put_if_absent(self.path, _encode(mine)) and self._confirmed(mine):
                self.holder = mine
                self._start_heartbeat()
                self._heard_dead(current, reason)
                return
        raise LockHeldError(
            f"Could not take the lock {self.store.display(self.path)}: other writers keep "
            "racing for it.",
            "Make sure one run writes each checkpoint.",
        )

    def _confirmed(self, mine: Holder) -> bool:
        """Whether a lock just taken over is still ours a moment later: another writer that
        judged the same holder dead may have deleted it and created its own meanwhile."""
        time.sleep(TAKEOVER_SETTLE_SECONDS)
        current = self.read()
        return current is not None and current.token == mine.token

    def _wait_for_stop(self, holder: Holder) -> Holder | None:
        """A live holder whose run is over stops by itself: wait up to ``STOP_WAIT_SECONDS``
        for it to release the lock or die. Returns the holder then (None: released)."""
        over = self._run_over(holder)
        if over is None:
            return holder
        self.log.warning(
            "The checkpoint lock %s is held by %s, whose run is %s; waiting up to %g s for "
            "it to stop by itself.",
            self.store.display(self.path),
            holder.describe(),
            over,
            STOP_WAIT_SECONDS,
        )
        deadline = time.monotonic() + STOP_WAIT_SECONDS
        current: Holder | None = holder
        while current is not None and current.token == holder.token:
            if self.dead_reason(current) is not None or time.monotonic() >= deadline:
                return current
            time.sleep(min(0.25, STOP_WAIT_SECONDS))
            current = self.read()
        return current

    def _run_over(self, holder: Holder) -> str | None:
        if self.watch is None or not holder.run_id or holder.run_id == self.run_id:
            return None
        try:
            return self.watch.run_over(holder.run_id)
        except Exception as e:  # the refusal still names the holder
            self.log.warning("Could not read the state of run %s: %s", holder.run_id, e)
            return None

    def _held(self, holder: Holder) -> LockHeldError:
        what = (
            f"Checkpoint {self.store.display(self.path)} is being written by another "
            f"writer ({holder.describe()})."
        )
        remedy = (
            "Wait for it to finish, or terminate that run; a lock of a dead holder (process "
            "gone, lease expired) is taken over automatically."
        )
        over = self._run_over(holder)
        if over is not None:
            what += (
                f" Its run is {over}, yet its process still renews the lease and may write: it "
                "was not taken over."
            )
            remedy = (
                "A step whose run is over stops by itself once its calls in flight return (it "
                f"checks every {WATCH_SECONDS:g} s): run this again then. If it does not stop, "
                f"end process {holder.pid} on host {holder.host}."
            )
        if holder.token == UNREADABLE:
            until = datetime.fromtimestamp(holder.expires, UTC)
            remedy = (
                "It is taken over automatically after "
                f"{until:%Y-%m-%d %H:%M:%S} UTC, a lease after it was written; if you "
                "know no run writes this checkpoint, delete the lock file to go on now."
            )
        error = LockHeldError(what, remedy)
        error.holder = holder.describe()
        return error

    def _heard_dead(self, holder: Holder, reason: str) -> None:
        if self.watch is None or holder.token == UNREADABLE:
            return
        try:
            self.watch.holder_died(holder, reason)
        except Exception as e:  # this run goes on
            self.log.warning("Could not report the dead holder's run %s: %s", holder.run_id, e)

    # -- holding it ----------------------------------------------------------------------
    def halted(self) -> str | None:
        """Why this writer must start no more calls (lock lost, run over), or None. Cheap:
        the clock is read, storage is not."""
        self._trust()
        return self.lost or self.stopped

    def check(self) -> None:
        """Raise ``LockHeldError`` unless this writer may still write: its lease is trusted
        (see the module docstring) and was not taken over. Every write calls it first."""
        self._trust()
        if self.lost is not None:
            raise LockHeldError(self.lost)

    def _trust(self) -> None:
        """Lose the lock once the lease is no longer trusted by this process's clock."""
        holder = self.holder
        if holder is None or self.lost is not None:
            return
        if self.clock() > holder.expires - (1 - TRUSTED) * self.lease_seconds:
            self._lose(
                f"This run's lease of the lock {self.store.display(self.path)} ran out: its "
                f"process was paused, or could not renew the lease, for about "
                f"{self.lease_seconds:.0f} s, so another writer may hold the lock now. It "
                "starts no more calls and writes nothing more; what it flushed before is "
                "kept. Run it again: it resumes."
            )

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            self.log.error("%s", why)

    def renew(self) -> None:
        """Extend the lease (the heartbeat calls it), unless this writer lost the lock."""
        self._trust()
        if self.holder is None or self.lost is not None:
            return
        current = self.read()
        if current is None or current.token != self.holder.token:
            taker = (
                f"another writer ({current.describe()})" if current else "someone who deleted it"
            )
            self._lose(
                f"The lock {self.store.display(self.path)} was taken over by {taker} while this "
                "run held it: the run was probably paused for longer than its "
                f"{self.lease_seconds:.0f} s lease. It starts no more calls and writes nothing "
                "more; what it flushed before is kept. Run it again once the other writer is "
                "done: it resumes."
            )
            return
        renewed = self._new_holder(since=self.holder.since)
        self._trust()  # paused during the read: the lock may be another's by now
        if self.lost is None:
            self.store.put(self.path, _encode(renewed))
            self.holder = renewed

    def release(self) -> None:
        """Stop the heartbeat and delete the lock file, unless this writer lost it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.holder is None:
            return
        self._trust()
        if self.lost is None:
            current = self.read()
            if current is not None and current.token == self.holder.token:
                self.store.delete([self.path])
        self.holder = None

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        interval = max(self.lease_seconds / 3.0, 0.05)
        tick = min(interval, WATCH_SECONDS) if self.watch is not None else interval

        def beat() -> None:
            due = time.monotonic() + interval
            while not self._stop.wait(tick):
                if time.monotonic() >= due:
                    try:
                        self.renew()
                        due = time.monotonic() + interval
                    except Exception as e:  # a failed renewal must not kill the run
                        self.log.warning("Could not renew the checkpoint lock: %s", e)
                self._ask_watch()

        self._thread = threading.Thread(target=beat, name="checkpoint-lease", daemon=True)
        self._thread.start()

    def _ask_watch(self) -> None:
        if self.watch is None or self.stopped is not None or self.lost is not None:
            return
        try:
            reason = self.watch.stop_reason()
        except Exception as e:  # the lease still guards the writes
            self.log.warning("Could not check this run's state: %s", e)
            return
        if reason is not None:
            self.stopped = reason
            self.log.warning(
                "Stopping: %s. No more calls start; what is done is kept and the lock %s released.",
                reason,
                self.store.display(self.path),
            )


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
    if holder.launcher is not None and not isinstance(holder.launcher, int):
        return None
    return holder
