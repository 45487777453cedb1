"""A changed function is never silent: when the function (its code, a constant it names, or a
resource's request settings) changed but ``code_version`` did not, the first run that reuses
stored results says so in its log and metadata, keeps those results, and the run after is quiet.

Every test materializes two definitions of the same asset (same name, same ``code_version``)
against one checkpoint on disk, as a user who edits the function between runs does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers.jobs import ASSET, run_logs, stats, tickets

from checkpoint_assets import (
    CheckpointIOManager,
    JobMismatchError,
    checkpointed_asset,
    global_resume_asset,
    shard_partitions,
)
from checkpoint_assets.engine import Checkpoint, open_store

ID = "ticket_id"
WARNING = "the function changed since its stored results were computed"
Calls = list[list[int]]


class Model(dg.ConfigurableResource):  # type: ignore[misc]
    """A stand-in for a model client that declares its request settings (never the key)."""

    model: str
    temperature: float = 0.0
    api_key: str = "sk-secret-key"

    def checkpoint_fingerprint(self) -> dict[str, Any]:
        return {"model": self.model, "temperature": self.temperature}


class Runner:
    """Materializes an asset over ``tickets(n)`` into its checkpoints, on one instance (or only
    ``only``, an asset beside it)."""

    def __init__(self, tmp_path: Path) -> None:
        self.base_dir = str(tmp_path / "checkpoints")
        self.instance = dg.DagsterInstance.ephemeral()

    def __call__(
        self,
        asset: dg.AssetsDefinition,
        n: int = 12,
        resources: dict[str, Any] | None = None,
        partition_key: str | None = None,
        only: dg.AssetsDefinition | None = None,
        **config: Any,
    ) -> dg.ExecuteInProcessResult:
        @dg.asset(name="tickets", io_manager_key="source_io")
        def source() -> pl.DataFrame:
            return tickets(n)

        return dg.materialize(
            [source, asset, *([only] if only else [])],
            selection=[only] if only else None,
            partition_key=partition_key,
            instance=self.instance,
            resources={
                "io_manager": CheckpointIOManager(base_dir=self.base_dir),
                "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
                **(resources or {}),
            },
            run_config={"ops": {ASSET: {"config": config}}} if config else None,
        )

    def shards(self, asset: dg.AssetsDefinition, n: int = 12, **config: Any) -> list[Any]:
        """Materialize every shard of ``asset``, one run each; returns their results."""
        keys = asset.partitions_def.get_partition_keys() if asset.partitions_def else [None]
        return [self(asset, n, partition_key=key, **config) for key in keys]

    def warnings(self, result: dg.ExecuteInProcessResult) -> list[str]:
        return [m for m in run_logs(result, self.instance) if WARNING in m]

    def meta(self) -> dict[str, Any]:
        store = open_store(self.base_dir)
        checkpoint = CheckpointIOManager(base_dir=self.base_dir).checkpoint(
            dg.AssetKey(ASSET), None, None, store
        )
        return json.loads(store.get(checkpoint.files.meta))  # type: ignore[no-any-return]

    def write_meta(self, meta: dict[str, Any]) -> None:
        store = open_store(self.base_dir)
        checkpoint: Checkpoint = CheckpointIOManager(base_dir=self.base_dir).checkpoint(
            dg.AssetKey(ASSET), None, None, store
        )
        store.put(checkpoint.files.meta, json.dumps(meta).encode())


@pytest.fixture
def runner(tmp_path: Path) -> Runner:
    return Runner(tmp_path)


def _recorded(calls: Calls) -> Callable[[pl.DataFrame], None]:
    return lambda batch: calls.append(batch.get_column(ID).to_list())


def billing(calls: Calls, code_version: str = "1") -> dg.AssetsDefinition:
    record = _recorded(calls)

    @checkpointed_asset(source="tickets", id_column=ID, name=ASSET, code_version=code_version)
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        """Route every ticket to billing."""
        record(batch)
        return batch.select(ID, route=pl.lit("billing"))

    return routed


def billing_reformatted(calls: Calls) -> dg.AssetsDefinition:
    record = _recorded(calls)

    @checkpointed_asset(source="tickets", id_column=ID, name=ASSET, code_version="1")
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        """Every ticket goes to billing, for now (a docstring that says it differently)."""

        # Comments, blank lines and line breaks are not the function's behaviour.
        record(batch)
        return batch.select(
            ID,
            route=pl.lit("billing"),  # the only queue so far
        )

    return routed


def support(calls: Calls, code_version: str = "1") -> dg.AssetsDefinition:
    record = _recorded(calls)

    @checkpointed_asset(source="tickets", id_column=ID, name=ASSET, code_version=code_version)
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        """Route every ticket to billing."""
        record(batch)
        return batch.select(ID, route=pl.lit("support"))

    return routed


def prompted(calls: Calls, prompt: str) -> dg.AssetsDefinition:
    record = _recorded(calls)

    @checkpointed_asset(source="tickets", id_column=ID, name=ASSET, code_version="1")
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        record(batch)
        return batch.select(ID, route=pl.lit(prompt))

    return routed


def modelled(calls: Calls) -> dg.AssetsDefinition:
    record = _recorded(calls)

    @checkpointed_asset(source="tickets", id_column=ID, name=ASSET, code_version="1")
    def routed(batch: pl.DataFrame, llm: Model) -> pl.DataFrame:
        record(batch)
        return batch.select(ID, route=pl.lit(llm.model))

    return routed


def _ids(calls: Calls) -> list[int]:
    return [i for call in calls for i in call]


def test_a_changed_function_body_is_reported_and_stored_rows_are_kept(runner: Runner) -> None:
    first: Calls = []
    runner(billing(first), n=12)
    calls: Calls = []

    changed = runner(support(calls), n=16)

    found = stats(changed)
    assert found["function_changed"] is True
    assert found["function_changes"] == "the function's code"
    assert found["rows_resumed"] == 12 and found["rows_computed"] == 4
    assert _ids(calls) == [12, 13, 14, 15]  # the stored rows were not computed again
    [warning] = runner.warnings(changed)
    assert "the function's code" in warning and "12 stored result(s)" in warning
    assert "`code_version`" in warning and "`resume: false`" in warning
    routes = changed.output_for_node(ASSET).sort(ID).get_column("route").to_list()
    assert routes == ["billing"] * 12 + ["support"] * 4

    quiet = runner(support(calls), n=16)

    assert stats(quiet)["function_changed"] is False
    assert "function_changes" not in stats(quiet)
    assert runner.warnings(quiet) == []


def test_an_interrupted_run_leaves_the_change_to_be_reported_again(runner: Runner) -> None:
    runner(billing([]), n=12)
    calls: Calls = []
    record = _recorded(calls)

    @checkpointed_asset(source="tickets", id_column=ID, name=ASSET, code_version="1")
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        record(batch)
        raise KeyboardInterrupt  # stands for a killed run: it never finishes

    with pytest.raises(KeyboardInterrupt):
        runner(routed, n=16)

    again = runner(support(calls), n=16)

    assert stats(again)["function_changed"] is True
    assert len(runner.warnings(again)) == 1


def test_comments_docstrings_and_formatting_are_not_a_change(runner: Runner) -> None:
    runner(billing([]), n=12)
    calls: Calls = []

    result = runner(billing_reformatted(calls), n=12)

    assert stats(result)["function_changed"] is False
    assert runner.warnings(result) == []
    assert calls == []


def test_a_changed_constant_the_function_names_is_reported(runner: Runner) -> None:
    runner(prompted([], "Route this ticket."), n=12)

    result = runner(prompted([], "Route this ticket, politely."), n=12)

    assert stats(result)["function_changes"] == "the constant prompt"
    assert len(runner.warnings(result)) == 1


def test_a_bumped_code_version_is_a_new_job_as_before(runner: Runner) -> None:
    runner(billing([], code_version="1"), n=12)
    calls: Calls = []

    with pytest.raises(JobMismatchError, match="code_version"):
        runner(support(calls, code_version="2"), n=12)
    assert calls == []

    recomputed = runner(support(calls, code_version="2"), n=12, resume=False)

    assert stats(recomputed)["rows_computed"] == 12
    assert stats(recomputed)["function_changed"] is False
    assert runner.warnings(recomputed) == []
    calls.clear()
    quiet = runner(support(calls, code_version="2"), n=12)
    assert stats(quiet)["function_changed"] is False
    assert calls == []
    assert runner.meta()["job"]["code_version"] == "2"
    assert runner.meta()["function_fingerprint"]["code"]


def test_bumping_code_version_after_the_report_names_the_step_that_starts_the_new_job(
    runner: Runner,
) -> None:
    runner(billing([], code_version="1"), n=12)
    reported = runner(support([], code_version="1"), n=12)
    assert stats(reported)["function_changed"] is True  # the report says: bump code_version
    stored = sorted(p.name for p in Path(runner.base_dir).rglob("*"))
    calls: Calls = []

    with pytest.raises(JobMismatchError) as refused:
        runner(support(calls, code_version="2"), n=12)

    message = str(refused.value)
    assert "code_version: '1' stored, '2' now" in message
    assert "materialize once with `resume: false` in run config" in message
    assert "set a new `checkpoint_tag`" in message
    assert "set the asset's `code_version` back to '1'" in message
    assert "change the asset's `code_version`" not in message  # what the user just did
    assert calls == [] and sorted(p.name for p in Path(runner.base_dir).rglob("*")) == stored
    started = runner(support(calls, code_version="2"), n=12, resume=False)  # the step it names
    assert stats(started)["rows_computed"] == 12
    calls.clear()
    resumed = runner(support(calls, code_version="2"), n=12)  # later runs resume
    assert (stats(resumed)["rows_resumed"], calls) == (12, [])


def test_a_changed_resource_setting_is_reported_and_no_secret_is_stored(runner: Runner) -> None:
    asset = modelled([])
    runner(asset, n=12, resources={"llm": Model(model="small-1")})
    calls: Calls = []

    changed = runner(modelled(calls), n=12, resources={"llm": Model(model="large-2")})

    assert stats(changed)["function_changes"] == "the resource setting llm.model"
    [warning] = runner.warnings(changed)
    assert "llm.model" in warning and "large-2" not in warning
    assert calls == []
    meta = runner.meta()
    assert "resource:llm.temperature" in meta["function_fingerprint"]
    assert "sk-secret-key" not in json.dumps(meta) and "large-2" not in json.dumps(meta)

    same = runner(modelled([]), n=12, resources={"llm": Model(model="large-2", api_key="other")})
    assert stats(same)["function_changed"] is False


def test_an_old_checkpoint_without_a_function_fingerprint_resumes_quietly(
    runner: Runner,
) -> None:
    runner(billing([]), n=12)
    meta = runner.meta()
    del meta["function_fingerprint"]  # as older releases write it
    runner.write_meta(meta)
    calls: Calls = []

    resumed = runner(support(calls), n=12)

    assert stats(resumed)["function_changed"] is False
    assert runner.warnings(resumed) == []
    assert calls == []
    assert runner.meta()["function_fingerprint"]["code"]  # recorded from now on
    reported = runner(billing([]), n=12)
    assert stats(reported)["function_changes"] == "the function's code"


def test_without_checkpointing_nothing_is_compared_or_recorded(runner: Runner) -> None:
    runner(billing([]), n=12)
    before = runner.meta()

    in_memory = runner(support([]), n=12, checkpointing=False)

    assert "function_changed" not in stats(in_memory)
    assert runner.warnings(in_memory) == []
    assert runner.meta() == before
    checkpointed = runner(support([]), n=12)
    assert stats(checkpointed)["function_changed"] is True


def sharded(calls: Calls, shards: int | None, route: str) -> dg.AssetsDefinition:
    record = _recorded(calls)

    @checkpointed_asset(
        source="tickets",
        id_column=ID,
        name=ASSET,
        code_version="1",
        partitions_def=shard_partitions(shards) if shards else None,
    )
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        record(batch)
        return batch.select(ID, route=pl.lit(route))

    return routed


@pytest.mark.parametrize(("old", "new"), [(2, 4), (None, 2)], ids=["range", "table"])
def test_rows_imported_by_global_resume_from_another_function_are_reported(
    runner: Runner, old: int | None, new: int
) -> None:
    runner.shards(sharded([], old, "billing"))
    calls: Calls = []
    after = sharded(calls, new, "support")
    if old is None:  # unpartitioned checkpoints are read through the global resume table
        runner(after, only=global_resume_asset(after))

    results = runner.shards(after, global_resume=True)

    assert calls == []  # every row was imported
    for result in results:
        assert stats(result)["function_changes"] == "the constant route"
        assert len(runner.warnings(result)) == 1
    quiet = runner.shards(after)
    assert [stats(r)["function_changed"] for r in quiet] == [False] * new
