"""A checkpointed asset wired for tests: its input can be changed between runs and its calls
are recorded, so a test can say exactly which rows a run computed. The rows, settings and
functions it builds on are ``rows.py``'s (no Dagster), named here too for the tests of jobs.

The source asset lives in an in-memory IO manager, so every file under ``base_dir`` was written
by the checkpoint itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import polars as pl

from checkpoint_assets import CheckpointIOManager, checkpointed_asset
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.storage import Store, open_store
from helpers.rows import Storage as Storage
from helpers.rows import engine_settings as engine_settings
from helpers.rows import ids_in_shard as ids_in_shard
from helpers.rows import poisoned as poisoned
from helpers.rows import route as route
from helpers.rows import tickets as tickets

ASSET = "routed"


@dataclass
class Job:
    """One checkpointed asset, its source and the instance and storage its runs use."""

    storage: Storage
    data: dict[str, pl.DataFrame]
    source: dg.AssetsDefinition
    asset: dg.AssetsDefinition
    calls: list[list[Any]]
    instance: dg.DagsterInstance
    extra: list[dg.AssetsDefinition] = field(default_factory=list)

    @property
    def io_manager(self) -> CheckpointIOManager:
        base_dir, options = self.storage
        return CheckpointIOManager(base_dir=base_dir, storage_options=options)

    def set_input(self, df: pl.DataFrame) -> None:
        self.data["df"] = df

    def resources(self) -> dict[str, Any]:
        return {"io_manager": self.io_manager, "source_io": dg.InMemoryIOManager()}  # type: ignore[no-untyped-call]

    def materialize(
        self,
        partition_key: str | None = None,
        *,
        raise_on_error: bool = True,
        **config: Any,
    ) -> dg.ExecuteInProcessResult:
        """Materialize the source and the checkpointed asset; ``config`` is its run config."""
        run_config = {"ops": {ASSET: {"config": config}}} if config else None
        return dg.materialize(
            [self.source, self.asset],
            instance=self.instance,
            resources=self.resources(),
            partition_key=partition_key,
            run_config=run_config,
            raise_on_error=raise_on_error,
        )

    def load_downstream(self, downstream: dg.AssetsDefinition) -> Any:
        """Materialize ``downstream`` (which reads the asset) and return what it received."""
        result = dg.materialize(
            [self.source, self.asset, downstream],
            selection=[downstream],
            instance=self.instance,
            resources=self.resources(),
        )
        return result.output_for_node(downstream.key.path[-1])

    def computed_ids(self) -> list[Any]:
        """Every id the function was called with, in call order, over all runs so far."""
        return [i for call in self.calls for i in call]

    def store(self) -> Store:
        base_dir, options = self.storage
        return open_store(base_dir, options)

    def checkpoint(self, partition: str | None = None, tag: str | None = None) -> Checkpoint:
        return self.io_manager.checkpoint(dg.AssetKey(ASSET), tag, partition, self.store())

    def files(self) -> dict[str, bytes]:
        """Every file under ``base_dir`` and its content."""
        store = self.store()
        return {f.path: store.get(f.path) for f in store.list_recursive(store.root)}


def build_job(
    storage: Storage,
    df: pl.DataFrame,
    *,
    fn: Callable[[pl.DataFrame], pl.DataFrame] = route,
    instance: dg.DagsterInstance | None = None,
    **asset_kwargs: Any,
) -> Job:
    """A job over ``df`` whose function ``fn`` is recorded call by call."""
    data = {"df": df}
    calls: list[list[Any]] = []

    @dg.asset(name="tickets", io_manager_key="source_io")
    def source() -> pl.DataFrame:
        return data["df"]

    kwargs: dict[str, Any] = {"checkpoint_interval": 4, "retry_delay_seconds": 0.0}
    kwargs.update(asset_kwargs)

    @checkpointed_asset(source="tickets", id_column="ticket_id", name=ASSET, **kwargs)
    def asset(batch: pl.DataFrame) -> pl.DataFrame:
        calls.append(batch.get_column("ticket_id").to_list())
        return fn(batch)

    return Job(
        storage=storage,
        data=data,
        source=source,
        asset=asset,
        calls=calls,
        instance=instance or dg.DagsterInstance.ephemeral(),
    )


class Labeller(dg.ConfigurableResource):  # type: ignore[misc]
    """A stand-in for a model client: configured in Definitions, used by the function."""

    prefix: str


def materialize_asset(
    storage: Storage,
    asset: dg.AssetsDefinition,
    df: pl.DataFrame,
    *,
    instance: dg.DagsterInstance | None = None,
    partition_key: str | None = None,
    resources: dict[str, Any] | None = None,
    raise_on_error: bool = True,
    config: dict[str, Any] | None = None,
) -> dg.ExecuteInProcessResult:
    """Materialize ``asset`` (any checkpointed asset reading ``tickets``) with ``df`` as its
    source, beside ``resources``; ``config`` is its run config."""

    @dg.asset(name="tickets", io_manager_key="source_io")
    def source() -> pl.DataFrame:
        return df

    base_dir, options = storage
    return dg.materialize(
        [source, asset],
        instance=instance or dg.DagsterInstance.ephemeral(),
        resources={
            "io_manager": CheckpointIOManager(base_dir=base_dir, storage_options=options),
            "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
            **(resources or {}),
        },
        partition_key=partition_key,
        run_config={"ops": {asset.key.path[-1]: {"config": config}}} if config else None,
        raise_on_error=raise_on_error,
    )


def stats(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    """The checkpointed asset's materialization metadata as plain values."""
    materializations = result.asset_materializations_for_node(ASSET)
    assert len(materializations) == 1
    return {k: v.value for k, v in materializations[0].metadata.items()}


def step_error(result: dg.ExecuteInProcessResult) -> str:
    """The user-facing error that failed the step: its class name and message."""
    (failure,) = result.get_step_failure_events()
    error = failure.step_failure_data.error
    while error is not None and error.cause is not None and error.cls_name.startswith("Dagster"):
        error = error.cause
    assert error is not None
    return f"{error.cls_name}: {error.message}"


def run_logs(result: dg.ExecuteInProcessResult, instance: dg.DagsterInstance) -> list[str]:
    """The user-facing log messages of a run (``context.log`` lines)."""
    return [e.user_message for e in instance.all_logs(result.run_id) if e.user_message]


def parts_by_partition(table: str) -> dict[str, str]:
    """partition -> parts, from the table `checkpoint-assets status` prints."""
    header, *lines = table.strip("\n").splitlines()
    column = {name: header.index(name) for name in ("partition", "rows ok", "parts", "size")}

    def cell(line: str, name: str, end: str) -> str:
        return line[column[name] : column[end]].strip()

    return {cell(line, "partition", "rows ok"): cell(line, "parts", "size") for line in lines}
