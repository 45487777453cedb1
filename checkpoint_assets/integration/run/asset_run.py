"""One materialization of a checkpointed asset: the shards of its run, what they share, and
running (or estimating) each of them."""

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import polars as pl

from checkpoint_assets.engine.calls.batches import PerRow
from checkpoint_assets.engine.calls.budget import Spend
from checkpoint_assets.engine.calls.caller import BatchFn
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.layout import DEFAULT_TAG
from checkpoint_assets.engine.errors import (
    BatchesPendingError,
    BudgetExceededError,
    CheckpointError,
    RunStoppedError,
    TooManyFailuresError,
)
from checkpoint_assets.engine.loop import runner
from checkpoint_assets.engine.loop.shard_run import OwnLoop
from checkpoint_assets.engine.plan import function_fingerprint
from checkpoint_assets.engine.plan.estimate import Estimate, Requests, estimate
from checkpoint_assets.engine.plan.inputs import Inputs, Limited
from checkpoint_assets.engine.plan.start import Job
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.settings import RunStats, Settings
from checkpoint_assets.engine.sharding.scheme import Scheme
from checkpoint_assets.engine.storage import Store
from checkpoint_assets.engine.storage.base import Usage
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.run import dry_run, run_config
from checkpoint_assets.integration.run.definition import Definition
from checkpoint_assets.integration.run.ranged import (
    FAILED,
    MATERIALIZED,
    NOT_RUN,
    ShardOutcome,
    ranged_failure,
    read_in_run,
)
from checkpoint_assets.integration.run.run_config import CheckpointRunConfig
from checkpoint_assets.integration.run.run_watch import DagsterRunWatch
from checkpoint_assets.integration.run.saved import saved_on_failure
from checkpoint_assets.integration.store.io_manager import (
    CheckpointIOManager,
    checkpoint_io_manager,
)
from checkpoint_assets.integration.store.source import ShardRows, user_columns
from checkpoint_assets.integration.watch.global_resume import global_rows
from checkpoint_assets.integration.watch.pending import end_pending
from checkpoint_assets.integration.watch.spend import AssetSpend

JOB_FORMAT = 1


@dataclass(frozen=True)
class AssetRun:
    """One materialization of a checkpointed asset: what its shards share, and running them."""

    context: dg.AssetExecutionContext
    config: CheckpointRunConfig
    source: pl.LazyFrame
    keys: list[str | None]
    call: BatchFn | PerRow | OwnLoop  # Calls.bind's
    settings: Settings
    job: dict[str, Any]
    printed: dict[str, str]  # the function's fingerprint, its resources' included
    io_manager: CheckpointIOManager
    store: Store
    started: Usage  # the store's counts when the step began (its source's first reads)
    imported: pl.DataFrame | None  # global resume: read once for every shard of a ranged run
    spend: AssetSpend | None
    results: ResultStore | None  # the result store, when the run reuses results by content
    parse: Callable[[dict[str, Any]], Mapping[str, Any]] | None  # Calls.parse
    requests: Requests  # how a dry run counts tokens
    ids_checked: bool  # the stored source's ids were found clean when it was stored
    # The metadata of each shard of a ranged run that materialized.
    _recorded: dict[str | None, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        context: dg.AssetExecutionContext,
        config: Any,
        source: pl.LazyFrame,
        asset: Definition,
    ) -> "AssetRun":
        """The run of ``asset`` that ``context`` executes, with its run ``config``."""
        calls = asset.calls
        io_manager = checkpoint_io_manager(context, asset.io_manager_key)
        multi = context.has_partition_key_range or context.has_partition_key
        keys: list[str | None] = list(context.partition_keys) if multi else [None]
        call = calls.bind(context, config)
        store = io_manager.store()
        started = io_manager.step_usage(asset.source_key)
        settings = run_config.apply(
            asset.settings, config, user_columns(source.collect_schema().names())
        )
        resources = {r: getattr(context.resources, r) for r in calls.resources}
        job = {
            "format": JOB_FORMAT,
            "asset": context.asset_key.to_user_string(),
            "code_version": asset.code_version,
            "id_column": settings.id_column,
            "input_columns": list(settings.input_columns),
        }
        imported = None
        if config.global_resume:
            tag = config.checkpoint_tag
            imported = global_rows(io_manager, store, context, job, keys, tag)
        return cls(
            context=context,
            config=config,
            source=source,
            keys=keys,
            call=call,
            settings=settings,
            job=job,
            printed={**calls.code, **function_fingerprint.of_resources(resources)},
            io_manager=io_manager,
            store=store,
            started=started,
            imported=imported,
            spend=_spend(context, settings, keys),
            results=_results(io_manager, asset.reuse, config),
            parse=calls.parse,
            requests=dry_run.requests(calls.request, resources.values()),
            ids_checked=io_manager.ids_checked(asset.source_key),
        )

    def materialize(self) -> pl.DataFrame | None:
        """Run every shard; the result of all, with the materialization's metadata.

        A run of one shard (or unpartitioned) returns its result, which Dagster records as its
        materialization. A run of several shards (a ranged run) records each shard's own
        materialization as soon as that shard ends (``_materialized``). It returns the result of
        all only when another step of the run reads it (an asset downstream, an asset check);
        Dagster then records each shard's materialization once more, from that output.
        Otherwise it returns None: nothing is recorded twice.
        """
        frames, stats = self._run_all()
        if self.ranged and not read_in_run(self.context):
            return None
        result = frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed")
        if self.ranged:  # each partition's materialization shows its own shard's figures
            for key, metadata in self._recorded.items():
                self.context.add_asset_metadata(metadata, partition_key=key)
            return result
        self.context.add_output_metadata(
            md.materialization(
                stats,
                self.config.checkpoint_tag or DEFAULT_TAG,
                self.config.checkpointing,
                self.store.usage().since(self.started),
                result,
                self.settings.id_column,
            )
        )
        if self.spend is not None:
            for key in self.keys:
                self.context.add_asset_metadata(self.spend.metadata(key), partition_key=key)
        return result

    @property
    def ranged(self) -> bool:
        """Whether the run holds several shards (a ranged run): each is its own outcome."""
        return len(self.keys) > 1

    def estimate(self) -> dict[str | None, Estimate]:
        """What a run of each shard would compute and cost, computing and writing nothing."""
        remote = not self.store.local
        shards = ShardRows(self.source, self.settings.id_column, self.keys, remote=remote)
        with shards as rows:
            try:
                rows.check_ids(stored_clean=self.ids_checked)
                return {key: self._estimate_one(key, rows.of(key)) for key in self.keys}
            except CheckpointError as e:
                raise e.in_dagster_terms() from None

    def _estimate_one(self, partition: str | None, rows: Inputs) -> Estimate:
        config, settings = self.config, self.settings
        checkpoint = None
        if config.checkpointing:
            asset_key, tag = self.context.asset_key, config.checkpoint_tag
            checkpoint = self.io_manager.checkpoint(asset_key, tag, partition, self.store)
        limit = config.limit
        content = self.results is not None
        return estimate(
            runner.prepare(
                rows if limit is None else Limited(rows, limit), settings, content=content
            ),
            settings,
            checkpoint,
            job=Job(dict(self.job), self.printed or None, self.parse),
            scheme=Scheme.of(partition),
            imported=self.imported,
            requests=self.requests,
            submitted=dry_run.submitted(checkpoint, settings.id_column, self.requests),
            results=self.results,
        )

    def _run_all(self) -> tuple[list[pl.DataFrame], list[RunStats]]:
        """Each shard's result and stats.

        The source's ids are checked whole before any shard runs. In a ranged run, a shard that
        fails does not stop the others (unless ``stop_at_failed_shard``); the run fails at its
        end, naming the failed shards. A stopped run (terminated, its budget reached) stops at
        once. A shard with too many failed rows, or with provider batches still pending, does
        not stop the others either: their retries are free.
        """
        frames: list[pl.DataFrame] = []
        stats: list[RunStats] = []
        outcomes: dict[str | None, ShardOutcome] = {}
        too_many: list[TooManyFailuresError] = []
        pending: dict[str | None, BatchesPendingError] = {}
        # On a failure: what the run spent counts, though no shard materializes.
        recorded = self.spend.recorded_on_failure() if self.spend else contextlib.nullcontext()
        remote = not self.store.local  # a source it stored is on the same store
        shards = ShardRows(self.source, self.settings.id_column, self.keys, remote=remote)
        with shards as rows, recorded:
            try:
                rows.check_ids(stored_clean=self.ids_checked)  # before any shard computes
            except CheckpointError as e:
                raise e.in_dagster_terms() from None
            mark = self.started
            for key in self.keys:
                failed = any(o.outcome == FAILED for o in outcomes.values())
                if self.settings.stop_at_failed_shard and (too_many or failed):
                    outcomes[key] = ShardOutcome(key, NOT_RUN)
                    continue
                try:
                    frame, one = self._run_saved(key, rows.of(key))
                except TooManyFailuresError as e:
                    too_many.append(e)
                    if self.ranged:
                        outcomes[key] = ShardOutcome(key, FAILED, e.in_dagster_terms())
                    continue
                except BatchesPendingError as e:
                    pending[key] = e  # its other shards are submitted too
                    continue
                except (RunStoppedError, BudgetExceededError) as e:
                    raise e.in_dagster_terms() from None  # the run is over for every shard
                except CheckpointError as e:
                    if not self.ranged:
                        raise e.in_dagster_terms() from None
                    outcomes[key] = ShardOutcome(key, FAILED, e.in_dagster_terms())
                    continue
                usage = self.store.usage()
                if self.ranged:
                    self._materialized(key, frame, one, usage.since(mark))
                mark = usage
                outcomes[key] = ShardOutcome(key, MATERIALIZED, stats=one)
                frames.append(frame)
                stats.append(one)
            if pending:
                raise end_pending(self.context, pending)
            if self.ranged and any(o.outcome != MATERIALIZED for o in outcomes.values()):
                raise ranged_failure(self.context, [outcomes[k] for k in self.keys])
            if too_many:
                raise TooManyFailuresError.of_several(too_many).in_dagster_terms()
        return frames, stats

    def _metadata(
        self, key: str | None, frame: pl.DataFrame, one: RunStats, usage: Usage
    ) -> dict[str, Any]:
        """The metadata of one shard's materialization."""
        config = self.config
        metadata = md.materialization(
            [one],
            config.checkpoint_tag or DEFAULT_TAG,
            config.checkpointing,
            usage,
            frame,
            self.settings.id_column,
        )
        if self.spend is not None:
            metadata.update(self.spend.metadata(key))
        return metadata

    def _materialized(
        self, key: str | None, frame: pl.DataFrame, one: RunStats, usage: Usage
    ) -> None:
        """Record shard ``key`` of a ranged run as materialized, with its own metadata, now."""
        metadata = self._recorded[key] = self._metadata(key, frame, one, usage)
        self.context.log_event(
            dg.AssetMaterialization(
                asset_key=self.context.asset_key, partition=key, metadata=metadata
            )
        )
        if self.spend is not None:
            self.spend.done.pop(key, None)  # its spend is in its materialization

    def _run_saved(self, key: str | None, rows: Inputs) -> tuple[pl.DataFrame, RunStats]:
        """Run one shard; on a failure or interrupt, say what its checkpoint holds."""
        checkpoint = self.io_manager.checkpoint(
            self.context.asset_key, self.config.checkpoint_tag, key, self.store
        )
        saved = saved_on_failure(
            self.context, checkpoint, key, self.settings.id_column, self.config.checkpointing
        )
        with saved:
            return self._run_one(key, rows, checkpoint)

    def _run_one(
        self, partition: str | None, rows: Inputs, checkpoint: Checkpoint
    ) -> tuple[pl.DataFrame, RunStats]:
        """Run one partition's checkpoint over its input rows; returns its result and stats."""
        context, spend = self.context, self.spend
        limit = self.config.limit
        rows = rows if limit is None else Limited(rows, limit)
        inputs = runner.prepare(rows, self.settings, content=self.results is not None)
        label = context.asset_key.to_user_string() + (f" {partition}" if partition else "")
        watch = DagsterRunWatch(context.instance, context.run.run_id, label)
        if spend is not None:
            spend.start(partition)
        shard = runner.RunContext(
            scheme=Scheme.of(partition),
            run_id=context.run.run_id,
            watch=watch,
            logger=context.log,  # type: ignore[arg-type]
            label=label,
            imported=self.imported,
            function_fingerprint=self.printed,
            spend=None if spend is None else spend.spend,
            results=self.results,
            parse=self.parse,
        )
        try:
            return runner.run(
                self.call, inputs, checkpoint, self.settings, job=self.job, context=shard
            )
        except RunStoppedError:
            watch.report_orphaned()  # after the lock is released: a new run may take it at once
            raise
        finally:
            if spend is not None:
                spend.finish(partition)


def _spend(
    context: dg.AssetExecutionContext, settings: Settings, keys: Sequence[str | None]
) -> AssetSpend | None:
    """The run's spend tally, with what the asset spent before, when the asset has a budget."""
    if settings.budget is None:
        return None
    label = context.asset_key.to_user_string()
    return AssetSpend(context, Spend(settings.budget, label=label), keys)


def _results(
    io_manager: CheckpointIOManager, reuse: bool | None, config: CheckpointRunConfig
) -> ResultStore | None:
    """The result store, when this run reuses results: run config's ``reuse``, else the
    asset's, else the IO manager's ``reuse_results``; never without checkpointing."""
    chosen = next(r for r in (config.reuse, reuse, io_manager.reuse_results) if r is not None)
    return io_manager.results() if chosen and config.checkpointing else None
