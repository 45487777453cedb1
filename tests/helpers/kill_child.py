"""Driver process for the kill tests: many runs of one checkpoint, each SIGKILLed at a chosen point.

Usage: ``python kill_child.py SPEC_FILE`` (a JSON file). The driver imports everything once,
then forks one process per cycle of ``spec["cycles"]``; that process installs the cycle's kill
point by wrapping the storage and checkpoint methods (no hook in the package), runs the job, and
SIGKILLs itself when the point is reached (``os.kill(os.getpid(), SIGKILL)``: no handler, no
flush, no cleanup). A cycle whose point is never reached finishes its run normally. The driver
reaps each process (so its pid is gone and its lock is stale) before forking the next; once
``spec["kills"]`` processes were killed it does one last clean run (``spec["final"]``) and
writes ``spec["report"]``: per run, its cycle, whether it was killed, its exit status and
duration.

Each call of the function appends one line ``<cycle>\\t<id>,<id>,...`` to ``spec["log"]`` when it
starts: a call is paid for once it is made, so the calls in flight at a kill count as made.

A cycle: ``point`` (see ``POINTS``), ``n`` (kill at the n-th matching event), ``rows`` (the input
is ids ``0..rows-1``: it grows from cycle to cycle, so each has work), ``interval``,
``concurrency``, ``delay`` (seconds per call), ``variant`` and ``at`` (seconds, for
``random_time``). ``spec["mode"]``: ``engine`` (``checkpoint_assets.engine.loop.runner.run``) or
``materialize`` (the shard ``spec["partition"]`` of a checkpointed asset through Dagster's
``materialize``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import polars as pl

from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.loop import lock as lock_module
from checkpoint_assets.engine.loop.lock import Lease
from checkpoint_assets.engine.loop.sink import PartWriter
from checkpoint_assets.engine.storage import local as local_module
from checkpoint_assets.engine.storage.local import LocalStore
from checkpoint_assets.engine.storage.objects import S3Store
from helpers.kills import die

ENGINE_CHECKPOINT = "killed/default/all"
ASSET = "routed"
SHARDS = 2

POINTS = (
    "part_inside",  # in the middle of writing a part (local: half the bytes; S3: during the PUT)
    "part_before_commit",  # a part written, not yet renamed (local) or PUT (S3)
    "part_after_commit",  # a part durable, the writer not yet told
    "compaction",  # the compacted part written, its inputs not yet deleted
    "finalize_merged",  # the merged file written, the parts not yet deleted
    "finalize_meta",  # the finished meta written, the lock not yet released
    "lock_takeover",  # taking over the lock of a killed run
    "in_flight",  # ``concurrency`` calls in flight at once
    "random_op",  # before or after the n-th storage request of any kind
    "random_time",  # at a random moment (``at`` seconds after the run starts)
)


def value(i: int) -> str:
    """The function's output for id ``i``: deterministic, so a stored row can be checked."""
    return f"v{(i * 2654435761) % 1000003}"


def source(rows: int) -> pl.DataFrame:
    ids = list(range(rows))
    return pl.DataFrame({"ticket_id": ids, "body": [str(i) for i in ids]})


class Counter:
    """Counts matching events; ``hit()`` is True at the n-th one."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0
        self.lock = threading.Lock()

    def hit(self) -> bool:
        with self.lock:
            self.seen += 1
            return self.seen == self.n


def _wrap(cls: type, name: str, make: Callable[[Any], Any]) -> None:
    setattr(cls, name, make(getattr(cls, name)))


def is_part(path: str) -> bool:
    return ".parquet.parts/" in path


def install(cycle: dict[str, Any], s3: bool) -> None:
    """Install the cycle's kill point (in this forked process only)."""
    point, variant = cycle["point"], cycle.get("variant", 0)
    count = Counter(cycle["n"])
    rng = random.Random(cycle.get("seed", 0))
    store_cls: type = S3Store if s3 else LocalStore

    if point == "part_inside" and not s3:
        real_open = open

        class HalfWrite:
            def __init__(self, f: Any) -> None:
                self.f = f

            def __enter__(self) -> HalfWrite:
                return self

            def __exit__(self, *exc: Any) -> None:
                self.f.close()

            def write(self, data: bytes) -> int:
                self.f.write(data[: len(data) // 2])
                self.f.flush()
                die()
                return 0

        def killing_open(path: str, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            f = real_open(path, mode, *args, **kwargs)
            if "w" in mode and is_part(str(path)) and count.hit():
                return HalfWrite(f)
            return f

        local_module.open = killing_open  # type: ignore[attr-defined]
    elif point == "part_inside":  # S3: die while the PUT is under way

        def put_inside(real: Any) -> Any:
            def put(self: Any, path: str, data: bytes) -> None:
                if is_part(path) and count.hit():
                    threading.Timer(rng.uniform(0.0, 0.004), die).start()
                real(self, path, data)

            return put

        _wrap(store_cls, "put", put_inside)
    elif point == "part_before_commit" and not s3:
        real_replace = os.replace

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if is_part(str(dst)) and count.hit():
                die()
            real_replace(src, dst, *args, **kwargs)

        os.replace = replace
    elif point in ("part_before_commit", "part_after_commit"):

        def put_part(real: Any) -> Any:
            def put(self: Any, path: str, data: bytes) -> None:
                hit = is_part(path) and count.hit()
                if hit and point == "part_before_commit":
                    die()
                real(self, path, data)
                if hit:
                    die()

            return put

        _wrap(store_cls, "put", put_part)
    elif point == "compaction":

        def write_part(real: Any) -> Any:
            def wrapped(
                self: Any, frame: Any, first: int, last: int | None = None, **kw: Any
            ) -> Any:
                part = real(self, frame, first, last, **kw)
                if last is not None and last > first and count.hit():
                    die()
                return part

            return wrapped

        _wrap(Checkpoint, "write_part", write_part)
    elif point == "finalize_merged":

        def put_merged(real: Any) -> Any:
            def put(self: Any, path: str, data: bytes) -> None:
                real(self, path, data)
                if path.endswith(".parquet") and not is_part(path) and count.hit():
                    die()

            return put

        _wrap(store_cls, "put", put_merged)
    elif point == "finalize_meta":

        def record_finish(real: Any) -> Any:
            def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
                real(self, *args, **kwargs)
                if count.hit():
                    die()

            return wrapped

        _wrap(PartWriter, "record_finish", record_finish)
    elif point == "lock_takeover":
        state = {"acquiring": False, "took_over": False}

        def acquire(real: Any) -> Any:
            def wrapped(self: Any) -> None:
                state["acquiring"] = True
                try:
                    real(self)
                finally:
                    state["acquiring"] = False

            return wrapped

        def delete(real: Any) -> Any:
            def wrapped(self: Any, paths: Any) -> None:
                paths = list(paths)
                locking = state["acquiring"] and any(p.endswith(".lock") for p in paths)
                if locking and variant == 0 and count.hit():
                    die()  # the stale holder read and judged dead, its lock not yet deleted
                real(self, paths)
                if locking:
                    state["took_over"] = True
                    if variant == 1 and count.hit():
                        die()  # the stale lock deleted, no new one yet

            return wrapped

        def put_if_absent(real: Any) -> Any:
            def wrapped(self: Any, path: str, data: bytes) -> bool:
                created = bool(real(self, path, data))
                if created and state["took_over"] and variant == 2 and count.hit():
                    die()  # the lock taken over, nothing else done yet
                return created

            return wrapped

        _wrap(Lease, "acquire", acquire)
        _wrap(store_cls, "delete", delete)
        _wrap(store_cls, "put_if_absent", put_if_absent)
    elif point == "random_op":

        def around(real: Any) -> Any:
            def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
                hit = count.hit()
                if hit and variant == 0:
                    die()
                out = real(self, *args, **kwargs)
                if hit:
                    die()
                return out

            return wrapped

        for name in ("put", "put_if_absent", "get", "list", "delete"):
            _wrap(store_cls, name, around)
    elif point == "random_time":
        timer = threading.Timer(cycle["at"], die)
        timer.daemon = True
        timer.start()
    elif point not in ("in_flight", "none"):
        raise ValueError(f"unknown kill point {point!r}")


def make_fn(spec: dict[str, Any], cycle: dict[str, Any], label: int) -> Any:
    fd = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    in_flight = 0
    lock = threading.Lock()
    full = Counter(cycle["n"]) if cycle["point"] == "in_flight" else None

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        nonlocal in_flight
        ids = batch.get_column("ticket_id").to_list()
        os.write(fd, f"{label}\t{','.join(map(str, ids))}\n".encode())  # the call is made
        with lock:
            in_flight += 1
            kill = full is not None and in_flight == cycle["concurrency"] and full.hit()
        if kill:
            die()
        time.sleep(cycle["delay"])
        with lock:
            in_flight -= 1
        return pl.DataFrame({"ticket_id": ids, "answer": [value(i) for i in ids]})

    return fn


def settings_of(cycle: dict[str, Any]) -> Settings:
    return Settings(
        id_column="ticket_id",
        input_columns=("body",),
        checkpoint_interval=cycle["interval"],
        max_concurrency=cycle["concurrency"],
        flush_seconds=30.0,
        min_flush_seconds=0.0,
        retry_delay_seconds=0.0,
    )


def run_engine(spec: dict[str, Any], cycle: dict[str, Any], label: int) -> None:
    settings = settings_of(cycle)
    store = open_store(spec["base_dir"], spec["options"])
    run(
        make_fn(spec, cycle, label),
        prepare(source(cycle["rows"]), settings),
        Checkpoint(store, ENGINE_CHECKPOINT),
        settings,
        job={"test": "kills"},
    )


def run_materialize(spec: dict[str, Any], cycle: dict[str, Any], label: int) -> None:
    import dagster as dg

    from checkpoint_assets import CheckpointIOManager, checkpointed_asset, shard_partitions

    @dg.asset(name="tickets", io_manager_key="source_io")
    def tickets() -> pl.DataFrame:
        return source(cycle["rows"])

    fn = make_fn(spec, cycle, label)

    @checkpointed_asset(
        source="tickets",
        id_column="ticket_id",
        name=ASSET,
        partitions_def=shard_partitions(SHARDS),
        checkpoint_interval=cycle["interval"],
        max_concurrency=cycle["concurrency"],
        min_flush_seconds=0.0,
        retry_delay_seconds=0.0,
    )
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        return fn(batch)  # type: ignore[no-any-return]

    result = dg.materialize(
        [tickets, routed],
        instance=dg.DagsterInstance.ephemeral(),
        partition_key=spec["partition"],
        resources={
            "io_manager": CheckpointIOManager(
                base_dir=spec["base_dir"], storage_options=spec["options"]
            ),
            "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
        },
        raise_on_error=False,
    )
    if not result.success:
        raise SystemExit(3)


def warm_botocore() -> None:
    """Parse botocore's S3 model once, in the driver: every forked run then inherits it instead
    of spending about a second on it (a speed-up of the test only; requests are unchanged)."""
    import botocore.loaders
    import botocore.session
    import s3fs  # noqa: F401 - imported once, before forking

    loader_cls: Any = botocore.loaders.Loader
    real_data, real_model = loader_cls.load_data_with_path, loader_cls.load_service_model
    data_cache: dict[Any, Any] = {}
    model_cache: dict[Any, Any] = {}

    def load_data_with_path(self: Any, name: str, *args: Any) -> Any:
        if (name, args) not in data_cache:
            data_cache[name, args] = real_data(self, name, *args)
        return data_cache[name, args]

    def load_service_model(
        self: Any, service: str, kind: str, api_version: str | None = None
    ) -> Any:
        key = (service, kind, api_version)
        if key not in model_cache:
            model_cache[key] = real_model(self, service, kind, api_version)
        return model_cache[key]

    loader_cls.load_data_with_path = load_data_with_path
    loader_cls.load_service_model = load_service_model
    loader = botocore.session.get_session().get_component("data_loader")
    for kind in ("service-2", "endpoint-rule-set-1", "paginators-1"):
        loader.load_service_model("s3", kind)
    loader.load_data("endpoints")
    loader.load_data("partitions")


def warm_up(mode: str) -> None:
    """Import, in the driver before forking, what a run imports lazily (the Dagster layer and
    an instance's storage, parts of numpy): every forked run then inherits it instead of paying
    seconds for it each time (a speed-up of the test only: the runs are unchanged). Nothing runs
    here: polars' thread pool, once started, would not survive a fork."""
    import numpy.ma  # noqa: F401 - polars imports it when it builds a Series from numpy

    if mode == "materialize":
        import dagster as dg

        import checkpoint_assets.integration.store.io_manager  # noqa: F401 - CheckpointIOManager

        dg.DagsterInstance.ephemeral()  # imports the run storage's modules


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    s3 = spec["base_dir"].startswith("s3://")
    job = run_materialize if spec["mode"] == "materialize" else run_engine
    warm_up(spec["mode"])
    if s3:
        warm_botocore()
    # A taker of a dead run's lock checks after TAKEOVER_SETTLE_SECONDS that no other taker
    # raced it. Each run here takes over the lock the killed run left, and none races it: the
    # half second would be most of each run, and most ``random_time`` kills would land in it.
    lock_module.TAKEOVER_SETTLE_SECONDS = 0.01
    report: list[dict[str, Any]] = []
    err = os.open(spec["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    kills = 0
    cycles = [*spec["cycles"], spec["final"]]
    for label, cycle in enumerate(cycles, start=1):
        if kills >= spec["kills"]:
            cycle = spec["final"]
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the cycle's process
            os.dup2(err, 2)
            code = 0
            try:
                install(cycle, s3)
                job(spec, cycle, label)
            except BaseException as e:  # an unexpected failure: the test reports it
                print(f"cycle {label} ({cycle['point']}): {e!r}", file=sys.stderr, flush=True)
                code = 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        kills += killed
        report.append(
            {
                "cycle": cycle,
                "killed": killed,
                "exit": code,
                "seconds": round(time.monotonic() - started, 3),
            }
        )
        if cycle is spec["final"] or (not killed and code != 0):
            break  # done, or a failure the test reports: no point in going on
    with open(spec["report"], "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
