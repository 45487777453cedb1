"""``checkpointed_asset``: a row-wise batch function as a resumable, sharded Dagster asset.

No ``from __future__ import annotations`` here: Dagster reads the body's annotations at runtime.
"""

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg
import polars as pl

from checkpoint_assets.engine.calls.budget import Spend
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.layout import DEFAULT_TAG
from checkpoint_assets.engine.errors import (
    BatchesPendingError,
    CheckpointError,
    RunStoppedError,
    TooManyFailuresError,
)
from checkpoint_assets.engine.loop import runner
from checkpoint_assets.engine.loop.shard_run import ShardRun
from checkpoint_assets.engine.plan import function_fingerprint
from checkpoint_assets.engine.plan.estimate import Estimate, Requests, estimate
from checkpoint_assets.engine.plan.inputs import Inputs, Limited
from checkpoint_assets.engine.plan.opening import Job
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.settings import RunStats, Settings
from checkpoint_assets.engine.sharding.scheme import Scheme
from checkpoint_assets.engine.storage import Store
from checkpoint_assets.engine.storage.base import Usage
from checkpoint_assets.integration import dry_run, run_config
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.arguments import (
    AssetArguments,
    CommonArguments,
    SourceSpec,
    keyword_arguments_of,
)
from checkpoint_assets.integration.function import Signature
from checkpoint_assets.integration.global_resume import global_rows
from checkpoint_assets.integration.io_manager import CheckpointIOManager, checkpoint_io_manager
from checkpoint_assets.integration.pending import end_pending
from checkpoint_assets.integration.run_config import CheckpointRunConfig
from checkpoint_assets.integration.run_watch import DagsterRunWatch
from checkpoint_assets.integration.saved import saved_on_failure
from checkpoint_assets.integration.source import (
    ShardRows,
    as_lazy,
    user_columns,
)
from checkpoint_assets.integration.spend import AssetSpend

JOB_FORMAT = 1


@keyword_arguments_of(AssetArguments)
def checkpointed_asset(
    arguments: AssetArguments,
) -> Callable[[Callable[..., Any]], dg.AssetsDefinition]:
    """Turn ``fn(batch: pl.DataFrame) -> pl.DataFrame`` into a checkpointed Dagster asset.

    ``fn`` receives batches of ``batch_size`` rows (the id and the input columns). It returns the
    id and its output columns for those rows, in any order. It may be an ``async def``. Its
    other parameters are Dagster resources by name, and one named ``context`` gets the asset's
    execution context. Results are flushed to the checkpoint as Parquet parts every
    ``checkpoint_interval`` rows; an interrupted run resumes by id. Partitions from
    :func:`shard_partitions` split the input into shards that run in parallel.

    Raise :class:`RetryAfter` when the endpoint rate limits, or let an HTTP 429/503/529 from
    ``httpx``, ``openai`` or ``anthropic`` through. That call waits and is sent again. The
    shard's concurrency follows what the endpoint sustains.

    Every argument is keyword-only; they are the fields of ``AssetArguments`` (listed below).

    Example::

        @checkpointed_asset(source="tickets", id_column="ticket_id",
                            partitions_def=shard_partitions(4))
        def ticket_routing(batch: pl.DataFrame, llm: LLMResource) -> pl.DataFrame:
            return batch.select("ticket_id", route=pl.lit("billing"))
    """

    def decorator(fn: Callable[..., Any]) -> dg.AssetsDefinition:
        signature = Signature.of(fn, arguments.batch_size)
        calls = Calls(
            resources=signature.resources,
            code=function_fingerprint.of_function(fn),  # resources add theirs at run time
            bind=lambda context, config: signature.bind(fn, context),
        )
        return define(fn, calls, arguments)

    return decorator


@dataclass(frozen=True)
class Calls:
    """How an asset's rows are computed.

    - ``resources``: the resources it needs (their fingerprints join its code's);
    - ``bind``: what it calls each run (the function with its resources, or a ``ProviderJob``);
    - ``loop``: the engine's work loop for it (None: ``runner.Run``);
    - ``request``: a row's request body, of a request/parse asset (a dry run counts its tokens);
    - ``parse``: a request/parse asset's that keeps its answers; it reads the answers of rows
      taken from the result store.
    """

    resources: tuple[str, ...]
    code: dict[str, str]
    bind: Callable[[dg.AssetExecutionContext, Any], Any]
    loop: type[ShardRun] | None = None
    config: type[CheckpointRunConfig] = CheckpointRunConfig
    request: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None
    parse: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None


def define(
    fn: Callable[..., Any], calls: Calls, a: CommonArguments, kinds: set[str] | None = None
) -> dg.AssetsDefinition:
    """The Dagster asset that runs ``calls`` over the shards of ``a.source`` (``fn``: its name
    and docstring)."""
    source_key = _source_key(a.source)
    base = Settings(
        id_column=a.id_column, input_columns=tuple(a.input_columns or ()), **a.settings()
    )

    def body(
        context: dg.AssetExecutionContext, config: Any, source: Any
    ) -> Iterator[dg.Output[pl.DataFrame]]:
        shards = _AssetRun.of(context, config, as_lazy(source), calls, a, base, source_key)
        if config.dry_run:
            dry_run.report(context, shards.estimate())
            return  # no output: nothing materializes (see dry_run.py)
        yield dg.Output(shards.materialize())

    body.__annotations__["config"] = calls.config  # Dagster reads the run config's class here
    body.__doc__ = fn.__doc__
    asset: dg.AssetsDefinition = dg.asset(**_asset_options(fn, calls, a, source_key, kinds))(body)
    return asset


_RESULT = dg.PythonObjectDagsterType(pl.DataFrame)


def _asset_options(
    fn: Callable[..., Any],
    calls: Calls,
    a: CommonArguments,
    source_key: dg.AssetKey,
    kinds: set[str] | None,
) -> dict[str, Any]:
    """The arguments of ``dg.asset`` for the asset ``define`` builds."""
    return {
        "name": a.name or fn.__name__,
        "key_prefix": a.key_prefix,
        # The IO manager gives a source marked with the id column as a lazy scan.
        "ins": {
            "source": dg.AssetIn(
                key=source_key,
                metadata={md.ID_COLUMN: a.id_column},
                partition_mapping=a.source_partition_mapping,
            )
        },
        "partitions_def": a.partitions_def,
        "group_name": a.group_name,
        "code_version": a.code_version,
        "pool": a.pool,
        "tags": dict(a.tags) if a.tags else None,
        "description": a.description or inspect.getdoc(fn),
        "metadata": {
            **(a.metadata or {}),
            md.ID_COLUMN: a.id_column,
            md.SOURCE: source_key.to_user_string(),
            md.RETRY_FAILED: a.retry_failed,
        },
        "io_manager_key": a.io_manager_key,
        "output_required": False,  # a dry run yields no output
        "dagster_type": _RESULT,  # what a generator's annotation does not say
        "required_resource_keys": set(calls.resources) or None,
        "backfill_policy": a.backfill_policy,
        "kinds": {*(kinds or {"polars", "parquet"}), *(a.kinds or ())},
        "owners": list(a.owners) if a.owners else None,
        "op_tags": dict(a.op_tags) if a.op_tags else None,
        "retry_policy": a.retry_policy,
        "automation_condition": a.automation_condition,
    }


@dataclass(frozen=True)
class _AssetRun:
    """One materialization of a checkpointed asset: what its shards share, and running them."""

    context: dg.AssetExecutionContext
    config: CheckpointRunConfig
    source: pl.LazyFrame
    keys: list[str | None]
    call: Any  # the function with its resources, or a ProviderJob
    loop: type[ShardRun] | None
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

    @classmethod
    def of(
        cls,
        context: dg.AssetExecutionContext,
        config: Any,
        source: pl.LazyFrame,
        calls: Calls,
        a: CommonArguments,
        base: Settings,
        source_key: dg.AssetKey,
    ) -> "_AssetRun":
        io_manager = checkpoint_io_manager(context, a.io_manager_key)
        multi = context.has_partition_key_range or context.has_partition_key
        keys: list[str | None] = list(context.partition_keys) if multi else [None]
        call = calls.bind(context, config)
        store = io_manager.store()
        started = io_manager.step_usage(source_key)
        settings = run_config.apply(base, config, user_columns(source.collect_schema().names()))
        resources = {r: getattr(context.resources, r) for r in calls.resources}
        job = {
            "format": JOB_FORMAT,
            "asset": context.asset_key.to_user_string(),
            "code_version": a.code_version,
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
            loop=calls.loop,
            settings=settings,
            job=job,
            printed={**calls.code, **function_fingerprint.of_resources(resources)},
            io_manager=io_manager,
            store=store,
            started=started,
            imported=imported,
            spend=_spend(context, settings, keys),
            results=_results(io_manager, a, config),
            parse=calls.parse,
            requests=dry_run.requests(calls.request, resources.values()),
        )

    def materialize(self) -> pl.DataFrame:
        """Run every shard; the result of all, with the materialization's metadata."""
        frames, stats = self._run_all()
        result = frames[0] if len(frames) == 1 else pl.concat(frames, how="diagonal_relaxed")
        config = self.config
        self.context.add_output_metadata(
            md.materialization(
                stats,
                config.checkpoint_tag or DEFAULT_TAG,
                config.checkpointing,
                self.store.usage().since(self.started),
                result,
                self.settings.id_column,
            )
        )
        if self.spend is not None:
            for key in self.keys:
                self.context.add_asset_metadata(self.spend.metadata(key), partition_key=key)
        return result

    def estimate(self) -> dict[str | None, Estimate]:
        """What a run of each shard would compute and cost, computing and writing nothing."""
        remote = not self.store.local
        shards = ShardRows(self.source, self.settings.id_column, self.keys, remote=remote)
        with shards as rows:
            try:
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
        """Each shard's result and stats. A shard with too many failed rows, or with provider
        batches still pending, does not stop the others: their retries are free."""
        frames: list[pl.DataFrame] = []
        stats: list[RunStats] = []
        too_many: list[TooManyFailuresError] = []
        pending: dict[str | None, BatchesPendingError] = {}
        # On a failure: what the run spent counts, though no shard materializes.
        recorded = self.spend.recorded_on_failure() if self.spend else contextlib.nullcontext()
        remote = not self.store.local  # a source it stored is on the same store
        shards = ShardRows(self.source, self.settings.id_column, self.keys, remote=remote)
        with shards as rows, recorded:
            for key in self.keys:
                try:
                    frame, one = self._run_saved(key, rows.of(key))
                except TooManyFailuresError as e:
                    too_many.append(e)
                    continue
                except BatchesPendingError as e:
                    pending[key] = e  # its other shards are submitted too
                    continue
                except CheckpointError as e:
                    raise e.in_dagster_terms() from None
                frames.append(frame)
                stats.append(one)
            if pending:
                raise end_pending(self.context, pending)
            if too_many:
                raise TooManyFailuresError.of_several(too_many).in_dagster_terms()
        return frames, stats

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
            loop=self.loop,
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
    io_manager: CheckpointIOManager, a: CommonArguments, config: CheckpointRunConfig
) -> ResultStore | None:
    """The result store, when this run reuses results: run config's ``reuse``, else the
    asset's, else the IO manager's ``reuse_results``; never without checkpointing."""
    chosen = next(r for r in (config.reuse, a.reuse, io_manager.reuse_results) if r is not None)
    return io_manager.results() if chosen and config.checkpointing else None


def _source_key(source: SourceSpec) -> dg.AssetKey:
    if isinstance(source, dg.AssetsDefinition):
        return source.key
    if isinstance(source, dg.AssetKey):
        return source
    if isinstance(source, str):
        return dg.AssetKey.from_user_string(source)
    return dg.AssetKey(list(source))
