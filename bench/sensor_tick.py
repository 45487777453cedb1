"""One tick of ``failed_partitions_sensor`` over many shards, on a SQLite and a Postgres instance.

The history is what a platform team has after a week of backfills, at every size ``n``:

- one ranged backfill run that materialized all ``n`` shards (one event each);
- ``n / 100`` materializations that tolerated failed rows (``rows_failed > 0``), reported
  without a run, so the ``retry_failed`` path has work;
- ``n / 100`` failed single-shard runs (``dagster/partition``), and ``n / 200`` failed ranged
  runs of 5 shards each (``dagster/asset_partition_range_start``/``_end``);
- one ranged run of every shard in which one shard in ten failed, the others materialized as
  they ended (hundreds of failed shards at a thousand and more).

The sensor is evaluated as the daemon evaluates it (``evaluate_tick`` with its cursor) with
``backoff_seconds=0``, so the first tick requests a retry of every failed shard: in ranged runs,
as the asset's ``BackfillPolicy.single_run()`` asks. Reported per
size: the first tick (empty cursor: it reads every materialization), a following tick (median),
and the SQL statements each issued (counted on SQLAlchemy's engine events). Postgres is the
server of ``$DAGSTER_PG_*`` when set, else one started in a temporary folder (as the
deployment tests start it; needs the ``postgres`` extra and PostgreSQL's server binaries).
"""

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import dagster as dg
import polars as pl
import sqlalchemy

from bench.report import Result
from checkpoint_assets import checkpointed_asset, failed_partitions_sensor, shard_partitions

ASSET = "scored"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Statements:
    """Counts SQL statements sent by any SQLAlchemy engine while ``counting`` is on."""

    def __init__(self) -> None:
        self.count = 0
        self.counting = False
        sqlalchemy.event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", self._seen)

    def _seen(self, *args: Any) -> None:
        if self.counting:
            self.count += 1

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        self.count, self.counting = 0, True
        try:
            yield
        finally:
            self.counting = False

    def close(self) -> None:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "before_cursor_execute", self._seen)


def _history(instance: dg.DagsterInstance, n: int) -> dict[str, int]:
    """Write the history of the module docstring for ``n`` shards; returns what it wrote."""
    shards = shard_partitions(n)
    keys = shards.get_partition_keys()
    failing: set[str] = set()

    @dg.asset(name=ASSET, partitions_def=shards, backfill_policy=dg.BackfillPolicy.single_run())
    def history(context: dg.AssetExecutionContext) -> None:
        covered = context.partition_keys
        failed = [k for k in covered if k in failing]
        if failed:
            # As a checkpointed asset's ranged run: the shards that finished materialize.
            for key in covered:
                if key not in failing:
                    context.log_event(dg.AssetMaterialization(ASSET, partition=key))
            raise RuntimeError(f"shard(s) {failed} failed")

    quiet = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}

    def run(tags: dict[str, str], partition: str | None = None) -> bool:
        return dg.materialize(
            [history],
            instance=instance,
            partition_key=partition,
            tags=tags,
            run_config=quiet,
            raise_on_error=False,
        ).success

    def ranged(first: str, last: str) -> bool:
        return run(
            {
                "dagster/asset_partition_range_start": first,
                "dagster/asset_partition_range_end": last,
            }
        )

    assert ranged(keys[0], keys[-1])
    partial = keys[3::100]
    for key in partial:
        instance.report_runless_asset_event(
            dg.AssetMaterialization(ASSET, partition=key, metadata={"rows_failed": 2})
        )
    singles = keys[1::100]
    failing.update(singles)
    for key in singles:
        assert not run({}, key)
    ranges = [keys[i : i + 5] for i in range(50, n - 5, 200)]
    for block in ranges:
        failing.update(block)
        assert not ranged(block[0], block[-1])
    # A ranged run of every shard in which one in ten failed: hundreds of failed shards.
    failing.update(keys[7::10])
    assert not ranged(keys[0], keys[-1])
    return {
        "runs": len(instance.get_run_ids()),
        "failed_shards": len(failing),
        "shards_with_failed_rows": len(partial),
    }


def _sensor(n: int) -> tuple[dg.SensorDefinition, dg.Definitions]:
    @dg.asset(name="tickets")
    def tickets() -> pl.DataFrame:
        return pl.DataFrame({"ticket_id": [1]})

    @checkpointed_asset(
        source="tickets",
        id_column="ticket_id",
        partitions_def=shard_partitions(n),
        name=ASSET,
        backfill_policy=dg.BackfillPolicy.single_run(),  # its retries: ranged runs
    )
    def scored(batch: pl.DataFrame) -> pl.DataFrame:
        return batch

    sensor = failed_partitions_sensor(scored, backoff_seconds=0)
    return sensor, dg.Definitions(assets=[tickets, scored], sensors=[sensor])


def _ticks(
    instance: dg.DagsterInstance, n: int, statements: _Statements, repeat: int
) -> dict[str, float]:
    sensor, defs = _sensor(n)
    cursor: str | None = None
    seconds: list[float] = []
    queries: list[int] = []
    requested = 0
    for i in range(1 + max(repeat, 3)):
        context = dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs)
        with statements.measure():
            started = time.perf_counter()
            data = sensor.evaluate_tick(context)
            seconds.append(time.perf_counter() - started)
        queries.append(statements.count)
        cursor = data.cursor
        if i == 0:
            requested = len(data.run_requests or [])
    return {
        "first_tick_s": seconds[0],
        "first_tick_sql": queries[0],
        "next_tick_s": statistics.median(seconds[1:]),
        "next_tick_sql": statistics.median(queries[1:]),
        "retry_runs_requested": requested,
    }


@contextlib.contextmanager
def _sqlite() -> Iterator[dg.DagsterInstance]:
    with tempfile.TemporaryDirectory(prefix="bench-sensor-") as home:
        with open(os.path.join(home, "dagster.yaml"), "w") as f:
            f.write("telemetry:\n  enabled: false\n")
        with dg.DagsterInstance.from_config(home) as instance:
            yield instance


@contextlib.contextmanager
def _postgres_env() -> Iterator[dict[str, str]]:
    keys = ("HOST", "PORT", "USER", "PASSWORD", "DB")
    if all(f"DAGSTER_PG_{k}" in os.environ for k in keys):
        yield {f"DAGSTER_PG_{k}": os.environ[f"DAGSTER_PG_{k}"] for k in keys}
        return
    sys.path.insert(0, os.path.join(REPO, "tests", "e2e"))
    try:
        from deploy_services import postgres_server
    finally:
        sys.path.pop(0)
    with postgres_server() as env:
        yield env


@contextlib.contextmanager
def _postgres(env: dict[str, str]) -> Iterator[dg.DagsterInstance]:
    config = {
        "telemetry": {"enabled": False},
        "storage": {
            "postgres": {
                "postgres_db": {
                    "hostname": env["DAGSTER_PG_HOST"],
                    "port": int(env["DAGSTER_PG_PORT"]),
                    "username": env["DAGSTER_PG_USER"],
                    "password": env["DAGSTER_PG_PASSWORD"],
                    "db_name": env["DAGSTER_PG_DB"],
                    # The driver dagster-postgres installs: a bare postgresql:// means psycopg 3.
                    "scheme": "postgresql+psycopg2",
                }
            }
        },
    }
    import yaml

    with tempfile.TemporaryDirectory(prefix="bench-sensor-pg-") as home:
        with open(os.path.join(home, "dagster.yaml"), "w") as f:
            yaml.safe_dump(config, f)
        with dg.DagsterInstance.from_config(home) as instance:
            instance.wipe()  # a fresh history for each size
            instance.wipe_all_schedules()
            yield instance


def sensor_tick(sizes: tuple[int, ...], repeat: int, backends: tuple[str, ...]) -> list[Result]:
    """One result per backend: first and following tick, seconds and SQL statements, per size."""
    results: list[Result] = []
    statements = _Statements()
    try:
        for backend in backends:
            result = Result(
                f"sensor_tick_{backend}", f"failed_partitions_sensor tick, {backend} instance"
            )
            try:
                with contextlib.ExitStack() as stack:
                    env = stack.enter_context(_postgres_env()) if backend == "postgres" else {}
                    for n in sizes:
                        with _postgres(env) if backend == "postgres" else _sqlite() as instance:
                            started = time.perf_counter()
                            written = _history(instance, n)
                            written["history_s"] = round(time.perf_counter() - started, 1)
                            figures = _ticks(instance, n, statements, repeat)
                        result.details[str(n)] = {**written, **figures}
                        result.add(f"{n} shards: first tick", figures["first_tick_s"], "s")
                        result.add(f"{n} shards: first tick SQL", figures["first_tick_sql"], "")
                        result.add(f"{n} shards: next tick", figures["next_tick_s"], "s")
                        result.add(f"{n} shards: next tick SQL", figures["next_tick_sql"], "")
            except Exception as e:
                if not result.figures:
                    result.status, result.note = "error", f"{type(e).__name__}: {e}"
                else:
                    result.note = f"stopped early: {type(e).__name__}: {e}"
            results.append(result)
    finally:
        statements.close()
    return results
