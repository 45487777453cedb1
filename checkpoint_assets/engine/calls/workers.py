"""Workers take batches, process them through the ``Caller`` and hand the outcomes to the run loop.

A worker is a thread, or a task on the event loop of an ``async def`` function.

A worker goes on to its next batch as soon as a call returns, without a round trip through the
run loop. A batch holds a slot from when a worker takes it until the run loop has absorbed its
outcome. So calls in flight and outcomes waiting for the run loop are ``held`` batches at most
(the loss bound in sink.py). While the run loop waits for storage, workers stop taking batches.

The run loop is woken for several outcomes at once, not for each. It is woken:

- when ``wake_at`` outcomes wait (half the slots beyond one per worker);
- when a worker waits for a slot, ends or fails;
- in any case after ``LINGER_SECONDS``.

One-row calls to a remote model return hundreds of times a second. Waking a thread costs CPU
that the calls need.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

from checkpoint_assets.engine.calls.batches import Batch
from checkpoint_assets.engine.calls.caller import Caller, Outcome, run_blocking

LINGER_SECONDS = 0.02  # the longest an outcome waits for the run loop to be woken
Item = Outcome | BaseException | None  # None: a worker ended


class Handoff:
    """The slots of the batches a shard holds, and the outcomes on their way to the run loop."""

    def __init__(self, held: int, workers: int) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # the run loop waits here
        self._freed = threading.Condition(self._lock)  # worker threads wait here for a slot
        self._free = held
        self._wake_at = max(1, (held - workers) // 2)
        self._items: list[Item] = []
        self._urgent = False  # a worker waits for a slot, ended or failed
        self._waiting: list[asyncio.Future[None]] = []  # tasks waiting for a slot
        self._leaving = False

    # -- the workers' side ---------------------------------------------------------------
    async def take(self, loop: asyncio.AbstractEventLoop | None) -> bool:
        """A slot for the next batch; False when the workers leave. A worker thread (``loop``
        None) blocks until a slot is free; a task waits on ``loop``."""
        while True:
            with self._lock:
                if self._leaving:
                    return False
                if self._free:
                    self._free -= 1
                    return True
                self._urgent = True  # the run loop frees slots as it absorbs outcomes
                self._ready.notify()
                if loop is None:
                    self._freed.wait()
                    continue
                freed = loop.create_future()
                self._waiting.append(freed)
            await freed

    def put(self, item: Item) -> None:
        with self._lock:
            self._items.append(item)
            if not isinstance(item, Outcome):
                self._urgent = True
            if self._urgent or len(self._items) >= self._wake_at:
                self._ready.notify()

    # -- the run loop's side -------------------------------------------------------------
    def wait(self, timeout: float) -> list[Item]:
        """What the workers handed over, once woken (see the module docstring); [] when
        ``timeout`` passed with nothing."""
        with self._lock:
            if not self._urgent and len(self._items) < self._wake_at:
                self._ready.wait(min(timeout, LINGER_SECONDS) if self._items else timeout)
            items, self._items, self._urgent = self._items, [], False
            return items

    def release(self, count: int) -> None:
        """``count`` slots are free again: their outcomes are absorbed."""
        with self._lock:
            self._free += count
            self._freed.notify(count)
            waiting, self._waiting = self._waiting, []
        _wake(waiting)

    def leave(self) -> None:
        """Workers take no more batches (the calls in flight finish)."""
        with self._lock:
            self._leaving = True
            self._freed.notify_all()
            waiting, self._waiting = self._waiting, []
        _wake(waiting)


def start(caller: Caller, batches: Iterator[Batch], workers: int, held: int) -> Handoff:
    """Start ``workers`` workers taking ``batches``: tasks on the event loop of an ``async def``
    function, else threads. Each hands its outcomes, its error and its end to the handoff."""
    handoff = Handoff(held, workers)
    taking = threading.Lock()  # threads take batches one at a time
    loop = caller.loop
    if loop is None:
        for i in range(workers):
            steps = _work(caller, batches, handoff, taking, None)
            threading.Thread(
                target=run_blocking, args=(steps,), name=f"checkpoint-{i}", daemon=True
            ).start()
        return handoff
    tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks

    async def start_tasks() -> None:
        for _ in range(workers):
            task = loop.create_task(_work(caller, batches, handoff, taking, loop))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    asyncio.run_coroutine_threadsafe(start_tasks(), loop).result()
    return handoff


async def _work(
    caller: Caller,
    batches: Iterator[Batch],
    handoff: Handoff,
    taking: threading.Lock,
    loop: asyncio.AbstractEventLoop | None,
) -> None:
    """One worker, written once: on a thread (``loop`` None) it never suspends."""
    try:
        while await handoff.take(loop):
            if caller.stopping:
                return
            with taking:
                batch = next(batches, None)
            if batch is None:
                return
            handoff.put(await caller.aprocess(batch))
    except BaseException as e:  # handed to the run loop, which raises it
        handoff.put(e)
    finally:
        handoff.put(None)  # this worker is done


def _wake(waiting: list[asyncio.Future[None]]) -> None:
    """Wake the tasks waiting for a slot: one wake-up of their loop for them all."""
    if waiting:
        waiting[0].get_loop().call_soon_threadsafe(_set, waiting)


def _set(waiting: list[asyncio.Future[None]]) -> None:
    for freed in waiting:
        if not freed.done():
            freed.set_result(None)
