"""``CheckpointIOManager``: where checkpoints live, and how assets read them.

The method-calling chain, for a checkpointed asset:

1. The asset body calls ``io_manager.checkpoint(asset_key, tag, partition)``, which calls
   ``engine.run()``.
2. Dagster calls ``handle_output(context, result)``. There is nothing to write: the checkpoint is
   the output.
3. Downstream, ``load_input(context)`` returns every requested shard's result as one polars
   DataFrame (a LazyFrame if annotated).

For any other asset (it is a good default IO manager too):

- ``handle_output(context, obj)`` streams a polars DataFrame or LazyFrame, or a pyarrow Table, to
  Parquet. It orders the rows by the shard key of the checkpointed assets that read it
  (``source.py``).
- ``load_input(context)`` reads Parquet into polars, all requested partitions concatenated. A
  checkpointed asset or a LazyFrame input gets a lazy scan.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import dagster as dg
import fsspec
import polars as pl
import pyarrow as pa
from pydantic import Field, PrivateAttr

from checkpoint_assets.engine.checkpoints import layout
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.reuse import layout as reuse_layout
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.storage import Store, merge_options, open_store, s3_options
from checkpoint_assets.engine.storage.base import Usage
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.store import source
from checkpoint_assets.integration.store.base_dir import default_base_dir
from checkpoint_assets.integration.store.source import scan_result, user_columns
from checkpoint_assets.integration.store.stored import ids_refused, store_output

if TYPE_CHECKING:
    from dagster_aws.s3 import S3Resource
else:
    try:
        from dagster_aws.s3 import S3Resource
    except ModuleNotFoundError:  # the `s3` extra is not installed

        class S3Resource(dg.ConfigurableResource):
            """Stands in for dagster-aws' S3Resource: install `checkpoint-assets[s3]` for it."""


def resolve_env(value: Any) -> Any:
    """Resolve ``{"env": "VAR"}`` values (at any depth) from the environment."""
    if isinstance(value, Mapping):
        if set(value) == {"env"}:
            name = value["env"]
            if name not in os.environ:
                raise CheckpointError(
                    f"storage_options refers to the environment variable {name!r}, which is "
                    "not set in the process that runs the asset.",
                    "Set it there, or give the value directly.",
                )
            return os.environ[name]
        return {k: resolve_env(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env(v) for v in value]
    return value


class CheckpointIOManager(dg.ConfigurableIOManager):
    """Stores checkpoints (and ordinary polars/pyarrow outputs) as Parquet under ``base_dir``.

    Example::

        defs = dg.Definitions(
            assets=[tickets, ticket_routing],
            resources={"io_manager": CheckpointIOManager(base_dir="s3://bucket/checkpoints")},
        )
    """

    base_dir: str | None = Field(
        default=None,
        description=(
            "Where checkpoints and outputs are stored: a local path or any fsspec URI "
            "(s3://bucket/prefix). Default: a 'checkpoints' folder under $DAGSTER_HOME; refused "
            "when the instance is temporary (DAGSTER_HOME unset), which would lose them."
        ),
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Options for the fsspec filesystem (for s3fs: key, secret, endpoint_url, "
            'client_kwargs...). Any value may be {"env": "VAR"} to read it from the environment.'
        ),
    )
    s3_resource: S3Resource | None = Field(
        default=None,
        description=(
            "A dagster-aws S3Resource whose endpoint URL, region, keys and session token reach "
            "an s3:// base_dir (storage_options win where both set a value). Without it and "
            "without storage_options, the standard AWS environment chain applies."
        ),
    )
    reuse_results: bool = Field(
        default=False,
        description=(
            "Reuse results by content for every checkpointed asset stored here: a row whose "
            "function and input the result store holds takes its result, with no call. An "
            "asset's `reuse` wins. For deterministic functions (temperature 0)."
        ),
    )
    result_store: str | None = Field(
        default=None,
        description=(
            "Where the result store is: a local path or any fsspec URI, opened with "
            "storage_options. Default: the 'result-store' folder under base_dir."
        ),
    )
    _default_dir: str | None = PrivateAttr(default=None)
    _store: Store | None = PrivateAttr(default=None)
    _loading: dict[dg.AssetKey, Usage] = PrivateAttr(default_factory=dict)
    _ids_checked: set[dg.AssetKey] = PrivateAttr(default_factory=set)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        if self.base_dir is None:
            self._default_dir = default_base_dir(context.instance)

    # -- storage -------------------------------------------------------------------------
    def root(self) -> str:
        if self.base_dir:
            return self.base_dir
        home = os.environ.get("DAGSTER_HOME")
        if home:
            return os.path.join(home, "checkpoints")
        if self._default_dir:
            return self._default_dir
        return os.path.abspath(".checkpoints")

    def store(self) -> Store:
        """The store under ``base_dir``, one for the IO manager's life.

        Dagster makes one IO manager per run, so a run's reads and writes are counted in one
        place.
        """
        if self._store is None:
            self._store = self._open()
        return self._store

    def step_usage(self, source_key: dg.AssetKey) -> Usage:
        """The store's usage when the step of a checkpointed asset over ``source_key`` began:
        when it loaded that source (its scan's first reads), else now. What the store counts
        from then on is that step's: Dagster runs a process's steps one at a time."""
        started = self._loading.pop(source_key, None)
        return started if started is not None else self.store().usage()

    def _open(self) -> Store:
        options = resolve_env(self.storage_options)
        root = self.root()
        if self.s3_resource is not None:
            if fsspec.core.split_protocol(root)[0] not in ("s3", "s3a"):
                raise CheckpointError(
                    f"CheckpointIOManager got an s3_resource, but base_dir {root!r} is not an "
                    "s3:// URI.",
                    "Point base_dir at s3://bucket/prefix, or drop s3_resource.",
                )
            options = merge_options(_s3_resource_options(self.s3_resource), options)
        return open_store(root, options)

    def results(self) -> ResultStore:
        """The result store: ``result_store``, or its folder beside the checkpoints."""
        if self.result_store is None:
            store = self.store()  # its reads count with the step's
            return ResultStore(store, store.path(reuse_layout.FOLDER))
        return ResultStore(open_store(self.result_store, resolve_env(self.storage_options)))

    def checkpoint(
        self,
        asset_key: dg.AssetKey,
        tag: str | None,
        partition: str | None,
        store: Store | None = None,
    ) -> Checkpoint:
        """The checkpoint of one asset partition under one tag."""
        name = layout.checkpoint_name(asset_key.path, tag, partition)
        return Checkpoint(store or self.store(), name)

    # -- IOManager -----------------------------------------------------------------------
    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        if md.ID_COLUMN in (context.definition_metadata or {}):
            return  # the asset body wrote and finalized its checkpoint
        if obj is None:
            return
        if not isinstance(obj, pl.DataFrame | pl.LazyFrame | pa.Table):
            raise CheckpointError(
                f"CheckpointIOManager stores polars and pyarrow tables as Parquet; asset "
                f"{context.asset_key.to_user_string()} returned {type(obj).__name__}.",
                "Return a polars DataFrame, or give this asset another io_manager_key.",
            )
        store = self.store()
        path = self.output_path(store, context.asset_key, _partition_of(context))
        rows = store_output(store, path, obj, _downstream_id_columns(context))
        columns = len(user_columns(source.as_lazy(obj).collect_schema().names()))
        context.add_output_metadata({"path": store.display(path), "rows": rows, "columns": columns})

    def load_input(self, context: dg.InputContext) -> pl.DataFrame | pl.LazyFrame:
        upstream = context.upstream_output
        metadata = (upstream.definition_metadata if upstream else None) or {}
        keys: Sequence[str | None] = (
            list(context.asset_partition_keys) if context.has_asset_partitions else [None]
        )
        store = self.store()
        # A checkpointed asset's source keeps its shard key column, to select its shard's rows.
        as_source = md.ID_COLUMN in (context.definition_metadata or {})
        if as_source:  # the step's reads start here: its metadata counts them
            self._loading[context.asset_key] = store.usage()
        lazy = as_source or _wants_lazy(context)
        if md.ID_COLUMN in metadata:
            id_column = str(md.plain(metadata[md.ID_COLUMN]))
            frames = [self._load_checkpoint(context, store, id_column, k, lazy) for k in keys]
        else:
            frames = [self._load_output(context, store, k, lazy) for k in keys]
            if as_source:
                self._check_stored_ids(context, store, keys)
        if lazy:
            scans = [f.lazy() for f in frames]  # a shard not merged yet was read whole
            scanned = scans[0] if len(scans) == 1 else pl.concat(scans, how="diagonal_relaxed")
            return scanned if as_source else source.without_shard_keys(scanned)
        tables = [f for f in frames if isinstance(f, pl.DataFrame)]
        table = tables[0] if len(tables) == 1 else pl.concat(tables, how="diagonal_relaxed")
        return source.without_shard_keys(table)

    def ids_checked(self, source_key: dg.AssetKey) -> bool:
        """Whether the source just loaded was found, when it was stored, to hold no null or
        duplicated id of the checkpointed asset loading it (``stored.ids_refused``)."""
        return source_key in self._ids_checked

    def _check_stored_ids(
        self, context: dg.InputContext, store: Store, keys: Sequence[str | None]
    ) -> None:
        id_column = str(md.plain((context.definition_metadata or {})[md.ID_COLUMN]))
        self._ids_checked.discard(context.asset_key)
        for key in keys:
            path = self.output_path(store, context.asset_key, key)
            if ids_refused(store, path, id_column) != 0:
                return
        self._ids_checked.add(context.asset_key)

    # -- helpers -------------------------------------------------------------------------
    def output_path(self, store: Store, asset_key: dg.AssetKey, partition: str | None) -> str:
        """Where an ordinary (not checkpointed) output of an asset partition is stored."""
        return store.path(layout.output_name(asset_key.path, partition))

    def _load_output(
        self, context: dg.InputContext, store: Store, partition: str | None, lazy: bool
    ) -> pl.DataFrame | pl.LazyFrame:
        path = self.output_path(store, context.asset_key, partition)
        try:
            if not lazy:
                return pl.read_parquet(io.BytesIO(store.get(path)))
            if not store.exists(path):  # a scan would only fail when collected
                raise FileNotFoundError(path)
            return source.scan(store, path)
        except FileNotFoundError:
            raise CheckpointError(
                f"No stored output for {context.asset_key.to_user_string()}"
                f"{f' partition {partition}' if partition else ''} at {store.display(path)}.",
                "Materialize it first (with the same io_manager base_dir).",
            ) from None

    def _load_checkpoint(
        self,
        context: dg.InputContext,
        store: Store,
        id_column: str,
        partition: str | None,
        lazy: bool,
    ) -> pl.DataFrame | pl.LazyFrame:
        tag = _latest_tag(context, partition)
        checkpoint = self.checkpoint(context.asset_key, tag, partition, store)
        meta = checkpoint.meta_file.read()
        if meta is None:
            raise CheckpointError(
                f"No checkpoint for {context.asset_key.to_user_string()}"
                f"{f' partition {partition}' if partition else ''} at {checkpoint.url}.",
                "Materialize it first; a run with `checkpointing: false` stores nothing to load.",
            )
        outputs = list(meta.output_schema or {})
        if lazy:
            scanned = scan_result(checkpoint, id_column, outputs, meta.base_seq)
            if scanned is not None:
                return scanned
        return checkpoint.read_result(id_column, outputs, meta=meta)


def checkpoint_io_manager(
    context: dg.AssetExecutionContext, io_manager_key: str
) -> CheckpointIOManager:
    """The asset's IO manager, which must be a ``CheckpointIOManager``: it owns the storage."""
    io_manager = getattr(context.resources, io_manager_key, None)
    if not isinstance(io_manager, CheckpointIOManager):
        raise CheckpointError(
            f"Asset {context.asset_key.to_user_string()} stores checkpoints: its "
            f"io_manager_key {io_manager_key!r} must be a CheckpointIOManager, not "
            f"{type(io_manager).__name__}.",
            "Bind that key to CheckpointIOManager(...) in your Definitions' resources, or pass "
            "io_manager_key= naming one that is.",
        )
    return io_manager


def _s3_resource_options(resource: S3Resource) -> dict[str, Any]:
    return s3_options(
        endpoint_url=resource.endpoint_url,
        region_name=resource.region_name,
        aws_access_key_id=resource.aws_access_key_id,
        aws_secret_access_key=resource.aws_secret_access_key,
        aws_session_token=resource.aws_session_token,
        profile_name=resource.profile_name,
        use_ssl=resource.use_ssl,
        verify=resource.verify,
        max_attempts=resource.max_attempts,
        use_unsigned_session=resource.use_unsigned_session,
    )


def _partition_of(context: dg.OutputContext) -> str | None:
    if not context.has_asset_partitions:
        return None
    keys = context.asset_partition_keys
    if len(keys) != 1:
        raise CheckpointError(
            f"CheckpointIOManager stores one partition per output; asset "
            f"{context.asset_key.to_user_string()} produced {len(keys)} at once.",
            "Give the asset backfill_policy=BackfillPolicy.multi_run(1), or another "
            "io_manager_key for its output.",
        )
    return keys[0]


def _latest_tag(context: dg.InputContext, partition: str | None) -> str | None:
    """The checkpoint tag of the latest materialization of this partition, if recorded.

    A latest run with ``checkpointing: false`` stored nothing: say that the value loaded is the
    checkpoint of earlier runs, not that run's result.
    """
    try:
        instance = context.instance
    except Exception:
        return None
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(
            asset_key=context.asset_key, asset_partitions=[partition] if partition else None
        ),
        limit=1,
    ).records
    if not records or records[0].asset_materialization is None:
        return None
    metadata = records[0].asset_materialization.metadata
    checkpointing = metadata.get(md.CHECKPOINTING)
    if checkpointing is not None and checkpointing.value is False:
        context.log.warning(
            f"The latest materialization of {context.asset_key.to_user_string()}"
            f"{f' partition {partition}' if partition else ''} ran with `checkpointing: false`, "
            "which stores nothing: loading the checkpoint that earlier runs stored instead."
        )
    value = metadata.get(md.CHECKPOINT_TAG)
    return str(value.value) if value is not None else None


# The id columns of the checkpointed assets defined in this process, by their source's key
# (``declare_source``): what shows them where the run's asset graph does not.
_DECLARED: dict[dg.AssetKey, set[str]] = {}


def declare_source(source_key: dg.AssetKey, id_column: str) -> None:
    """Say that a checkpointed asset shards ``source_key``'s rows by ``id_column``: an output of
    that asset is stored keyed by it wherever it is materialized in this process."""
    _DECLARED.setdefault(source_key, set()).add(id_column)


def _downstream_id_columns(context: dg.OutputContext) -> list[str]:
    """The id columns of the checkpointed assets whose source is this output.

    The output is stored ordered by the first one's shard key, so each of their shards reads only
    its row groups. They are found in the code location's asset graph (a run of the Definitions'
    jobs, from the UI, the daemon or the CLI). Else they are the checkpointed assets defined in
    this process over it (``declare_source``): ``dg.materialize`` of the source alone, whose job
    holds only the assets it runs. Where neither shows one, the output is stored as it is, and a
    run in process, which sees no code location, says so in its log: each shard of a
    checkpointed asset defined elsewhere would then read the whole file to find its rows.
    """
    graph, whole = _asset_graph(context)
    found: set[str] = set()
    if graph is not None and graph.has(context.asset_key):
        name = context.asset_key.to_user_string()
        for key in graph.get(context.asset_key).child_keys:
            metadata = graph.get(key).metadata
            if md.ID_COLUMN in metadata and md.plain(metadata.get(md.SOURCE)) == name:
                found.add(str(md.plain(metadata[md.ID_COLUMN])))
    if not found and not whole:
        found = set(_DECLARED.get(context.asset_key, ()))
        if not found and graph is not None:
            context.log.info(
                f"{context.asset_key.to_user_string()} is stored as it is, not keyed by shard: "
                "this run shows no checkpointed asset that reads it. If one does, each of its "
                "shards reads the whole file to find its own rows. Materialize it through your "
                "Definitions (the UI, `dagster asset materialize`), or in the same process as "
                "the checkpointed asset's definition, to store it keyed."
            )
    return sorted(found)


def _asset_graph(context: dg.OutputContext) -> tuple[Any, bool]:
    """The asset graph the run sees, and whether it is the code location's whole graph."""
    try:
        step = context.step_context
    except Exception:  # an output context built for a test has no step
        return None, False
    try:
        return step.repository_def.asset_graph, True
    except Exception:  # in-process execution sets no repository: the run's job, unsubsetted
        job = step.job_def
        while job.asset_selection_data:
            job = job.asset_selection_data.parent_job_def
        return job.asset_layer.asset_graph, False


def _wants_lazy(context: dg.InputContext) -> bool:
    try:
        return context.dagster_type.typing_type is pl.LazyFrame
    except Exception:
        return False
