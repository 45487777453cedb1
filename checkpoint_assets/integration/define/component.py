"""``CheckpointedAssetComponent``: a checkpointed asset declared in a ``defs.yaml`` for ``dg``.

``build_defs`` calls the public API (``checkpointed_asset``, ``shard_partitions``,
``checkpoint_checks``, ``failed_partitions_sensor``, ``global_resume_asset``), so an asset
declared in YAML behaves exactly like one declared in Python. Each attribute is declared once:

- the attributes named like an argument of ``checkpointed_asset`` are made from
  ``AssetArguments``' fields (type, default, meaning);
- the sensor's defaults are read from its signature.

No ``from __future__ import annotations`` here: Dagster derives the YAML schema from the
annotations at runtime.
"""

import dataclasses
import enum
import importlib
import inspect
import json
import re
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_type_hints

import dagster as dg
from pydantic import BaseModel, Field, create_model

from checkpoint_assets.engine.calls.budget import Budget, Price
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.fields import DOC
from checkpoint_assets.integration.define.arguments import AssetArguments
from checkpoint_assets.integration.define.asset import checkpointed_asset
from checkpoint_assets.integration.define.checks import checkpoint_checks
from checkpoint_assets.integration.run.models import model_of
from checkpoint_assets.integration.store.io_manager import CheckpointIOManager
from checkpoint_assets.integration.store.partitions import shard_partitions
from checkpoint_assets.integration.watch.global_resume import global_resume_asset
from checkpoint_assets.integration.watch.sensor import failed_partitions_sensor


def _defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def _doc(description: str) -> dg.Resolver:
    """The field's description in the YAML schema (``dg`` shows it; pydantic's is not used)."""
    resolver: dg.Resolver = dg.Resolver.default(description=description)
    return resolver


_SENSOR = _defaults(failed_partitions_sensor)
# Arguments of checkpointed_asset that the YAML says its own way: source as a key string,
# partitions_def as a shard count (``shards``), backfill_policy and budget as mappings.
_OWN_FORM = {"source", "partitions_def", "backfill_policy", "budget"}
# Python objects with no YAML form: a Component that needs one is a Python asset instead.
_PYTHON_ONLY = {"source_partition_mapping", "retry_policy", "automation_condition"}
_PASSED_ON = [
    f for f in dataclasses.fields(AssetArguments) if f.name not in _OWN_FORM | _PYTHON_ONLY
]


def _attributes() -> type[dg.Model]:
    """The attributes that are arguments of ``checkpointed_asset``, from ``AssetArguments``."""
    types = get_type_hints(AssetArguments)
    attributes: dict[str, Any] = {
        f.name: (
            Annotated[types[f.name], _doc(f.metadata[DOC])],
            ... if f.default is dataclasses.MISSING else f.default,
        )
        for f in _PASSED_ON
    }
    return create_model("AssetAttributes", __base__=dg.Model, **attributes)


if TYPE_CHECKING:
    AssetAttributes = dg.Model
else:
    AssetAttributes = _attributes()


def _import_function(context: dg.ResolutionContext, reference: str) -> Callable[..., Any]:
    """``package.module:function``; ``.module:function`` is a module beside the defs.yaml."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise CheckpointError(
            f"fn must be 'module:function' (e.g. my_project.routing:route_batch, or "
            f".routing:route_batch for routing.py beside the defs.yaml); got {reference!r}."
        )
    if module_name.startswith("."):
        module_name = _component_module(context) + module_name
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not f"{module_name}.".startswith(f"{e.name}."):
            raise  # the module exists, something it imports does not
        raise CheckpointError(
            f"fn {reference!r}: there is no module {module_name!r}. Is the package installed "
            "in this environment, and is the module name spelled right?"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = "has no attribute" if fn is None else "has a non-callable"
        raise CheckpointError(
            f"fn {reference!r}: module {module_name!r} {found} {attr!r}; point fn at the batch "
            "function (batch: pl.DataFrame) -> pl.DataFrame."
        )
    return fn  # type: ignore[no-any-return]


def _component_module(context: dg.ResolutionContext) -> str:
    """The module name of the folder that holds the component's defs.yaml."""
    try:
        load = dg.ComponentLoadContext.from_resolution_context(context)
    except Exception:
        raise CheckpointError(
            "A relative fn (.module:function) needs the component to be loaded from a defs "
            "folder; use the absolute form package.module:function."
        ) from None
    folder = load.path if load.path.is_dir() else load.path.parent
    return load.defs_relative_module_name(folder)


BatchFunction = Annotated[
    Callable[..., Any],
    dg.Resolver(
        lambda context, value: _import_function(context, value),
        model_field_type=str,
        description=(
            "The batch function, as module:function (.module:function for a module beside this "
            "defs.yaml). It gets a polars DataFrame of up to batch_size rows (the id and "
            "the input columns) and returns the id and the output columns of those rows."
        ),
        examples=["my_project.routing:route_batch", ".batch:process_batch"],
    ),
]


class SingleRunBackfill(dg.Resolvable, dg.Model):
    """``{type: single_run}``: a backfill is one run over every shard it covers."""

    type: Literal["single_run"] = "single_run"


class MultiRunBackfill(dg.Resolvable, dg.Model):
    """``{type: multi_run, max_partitions_per_run: N}``: a backfill is runs of N shards each."""

    type: Literal["multi_run"] = "multi_run"
    max_partitions_per_run: int = 1


def _backfill_policy(
    context: dg.ResolutionContext, value: SingleRunBackfill | MultiRunBackfill | None
) -> dg.BackfillPolicy | None:
    if isinstance(value, MultiRunBackfill):
        return dg.BackfillPolicy.multi_run(value.max_partitions_per_run)
    return dg.BackfillPolicy.single_run() if value is not None else None


BackfillPolicy = Annotated[
    dg.BackfillPolicy | None,
    dg.Resolver(
        _backfill_policy,
        model_field_type=SingleRunBackfill | MultiRunBackfill,
        description=(
            "How a backfill runs the shards: {type: single_run} (one run, shard after shard) or "
            "{type: multi_run, max_partitions_per_run: N} (Dagster's default: one per shard)."
        ),
        examples=[{"type": "single_run"}, {"type": "multi_run", "max_partitions_per_run": 4}],
    ),
]


if TYPE_CHECKING:
    PriceSpec = dg.Model
    BudgetSpec = dg.Model
else:
    PriceSpec = model_of(Price, dg.Model, name="PriceSpec", module=__name__, doc="``Price``.")
    BudgetSpec = model_of(
        Budget,
        dg.Model,
        name="BudgetSpec",
        module=__name__,
        doc="Prices and spend limits (``Budget``).",
        types={"prices": dict[str, PriceSpec]},
    )


def _keys(declared: type) -> str:
    """The fields of a dataclass as a YAML mapping's keys, in braces."""
    return "{" + ", ".join(f.name for f in dataclasses.fields(declared)) + "}"


def _budget(context: dg.ResolutionContext, value: Any) -> Budget | None:
    if value is None:
        return None
    data = value.model_dump() if isinstance(value, BaseModel) else dict(value)
    return Budget(**data)


BudgetArgument = Annotated[
    Budget | None,
    dg.Resolver(
        _budget,
        model_field_type=BudgetSpec | None,
        description=(
            "Prices per model read against two usage_columns, and the spend limits: "
            + _keys(Budget).replace("prices", "prices: {model: " + _keys(Price) + "}")
            + "."
        ),
        examples=[
            {
                "prices": {"gpt-4o-mini": {"input": 0.15, "output": 0.6}},
                "input_tokens": "prompt_tokens",
                "output_tokens": "completion_tokens",
                "max_run_cost": 50,
            }
        ],
    ),
]


class FailedPartitionsSensor(dg.Resolvable, dg.Model):
    """Settings of the failed-partitions sensor."""

    max_retries: Annotated[int, _doc("Runs requested per failed shard at most.")] = _SENSOR[
        "max_retries"
    ]
    backoff_seconds: Annotated[
        float, _doc("Wait after a failure before its retry, doubled for every attempt.")
    ] = _SENSOR["backoff_seconds"]
    minimum_interval_seconds: Annotated[int, _doc("Time between sensor ticks.")] = _SENSOR[
        "minimum_interval_seconds"
    ]
    name: Annotated[str | None, _doc("Sensor name (default: <asset>_failed_partitions).")] = None
    default_status: Annotated[
        dg.DefaultSensorStatus,
        _doc("RUNNING starts the sensor when the code loads; STOPPED: turn it on in the UI."),
    ] = _SENSOR["default_status"]


class CheckpointedAssetScaffoldParams(BaseModel):
    """What ``dg scaffold defs checkpoint_assets.CheckpointedAssetComponent NAME`` may fill in."""

    source: str | None = Field(default=None, description="The upstream asset with the rows.")
    id_column: str | None = Field(default=None, description="Unique integer or string id.")
    fn: str | None = Field(
        default=None,
        description="The batch function as module:function (default: a stub in batch.py).",
    )
    shards: int | None = Field(default=None, description="Number of shards.")


class CheckpointedAssetScaffolder(dg.Scaffolder[CheckpointedAssetScaffoldParams]):
    """Writes a ``defs.yaml`` (every optional attribute listed, commented out, with its default)
    and, unless ``--fn`` names a function, a ``batch.py`` stub beside it."""

    @classmethod
    def get_scaffold_params(cls) -> type[CheckpointedAssetScaffoldParams]:
        return CheckpointedAssetScaffoldParams

    def scaffold(self, request: dg.ScaffoldRequest[CheckpointedAssetScaffoldParams]) -> None:
        if request.scaffold_format != "yaml":
            raise CheckpointError(
                "CheckpointedAssetComponent scaffolds a defs.yaml (--format yaml); in Python, use "
                "the checkpointed_asset decorator instead."
            )
        params = request.params
        id_column = params.id_column or "id"
        if params.fn is None:
            (request.target_path / "batch.py").write_text(_BATCH_STUB.format(id_column=id_column))
        values: dict[str, Any] = {
            "fn": params.fn or ".batch:process_batch",
            "source": params.source or "my_source",
            "id_column": id_column,
            "name": request.target_path.name,
        }
        if params.shards is not None:
            values["shards"] = params.shards
        # A placeholder source fails `dg check defs` until it names a real asset; say so.
        notes = {"source": "  # TODO: the upstream asset" if params.source is None else ""}
        lines = [f"type: {request.type_name}", "", "attributes:"]
        schema = CheckpointedAssetComponent.model().model_fields
        for key, field in CheckpointedAssetComponent.model_fields.items():
            lines += [f"  # {text}" for text in textwrap.wrap(schema[key].description or "", 94)]
            if key in values:
                lines.append(f"  {key}: {_yaml_value(values[key])}{notes.get(key, '')}")
            else:
                lines.append(f"  # {key}: {_yaml_value(field.default)}")
        (request.target_path / "defs.yaml").write_text("\n".join(lines) + "\n")


_BATCH_STUB = '''\
"""The batch function of this checkpointed asset (fn: .batch:process_batch in defs.yaml)."""

import polars as pl


def process_batch(batch: pl.DataFrame) -> pl.DataFrame:
    """Called with up to batch_size rows: the id and the input columns.

    Return the id and the output columns of those rows, in any order. Replace the body with
    the call to your model or API; results are checkpointed as each batch completes.
    """
    return batch.select("{id_column}", output=pl.lit("todo"))
'''


def _yaml_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str) and re.fullmatch(r"[\w.:/-]+", value):
        return value
    return json.dumps(value)  # JSON is YAML: null, true, 1.0, "quoted text"


@dg.scaffold_with(CheckpointedAssetScaffolder)
class CheckpointedAssetComponent(dg.Component, dg.Resolvable, AssetAttributes):
    """A resumable, sharded, row-wise batch job as a checkpointed Dagster asset.

    Results are flushed to Parquet as they are computed and an interrupted run resumes by row id;
    each shard is a partition. The same asset as ``checkpointed_asset`` declares in Python::

        type: checkpoint_assets.CheckpointedAssetComponent
        attributes:
          fn: my_project.routing:route_batch
          source: tickets
          id_column: ticket_id
          shards: 8
          checkpoint_checks: true
          failed_partitions_sensor: {max_retries: 3}

    The component binds no resources: the project binds ``io_manager`` to a
    ``CheckpointIOManager`` (e.g. in ``defs/resources.py``), unless ``base_dir`` is set.
    """

    fn: BatchFunction
    source: Annotated[
        str, _doc("The upstream asset with the rows (its key; a/b for a prefixed key).")
    ]
    shards: Annotated[
        int | None,
        _doc("Split the rows into this many shards, one partition each (default: one checkpoint)."),
    ] = None
    backfill_policy: BackfillPolicy = None
    budget: BudgetArgument = None
    base_dir: Annotated[
        str | None,
        _doc(
            "Bind a CheckpointIOManager with this base_dir (a local path or fsspec URI) under "
            "io_manager_key (default: bind nothing; the project binds it)."
        ),
    ] = None
    checkpoint_checks: Annotated[
        bool, _doc("Add the completeness and failed_rows asset checks.")
    ] = False
    global_resume_asset: Annotated[
        bool, _doc("Add <name>_global_resume, to resume across shard counts after a reshard.")
    ] = False
    failed_partitions_sensor: Annotated[
        bool | FailedPartitionsSensor,
        _doc(
            "true, or {max_retries, backoff_seconds, minimum_interval_seconds, name, "
            "default_status}: add a sensor that re-runs failed shards."
        ),
    ] = False

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        arguments = self._asset_arguments()
        io_manager_key: str = arguments["io_manager_key"]
        asset = checkpointed_asset(**arguments)(self.fn)
        assets = [asset]
        if self.global_resume_asset:
            assets.append(global_resume_asset(asset, io_manager_key=io_manager_key))
        sensors = []
        if self.failed_partitions_sensor:
            sensor = self.failed_partitions_sensor
            if not isinstance(sensor, FailedPartitionsSensor):
                sensor = FailedPartitionsSensor()
            sensors.append(failed_partitions_sensor(asset, **sensor.model_dump()))
        resources = {}
        if self.base_dir is not None:
            resources[io_manager_key] = CheckpointIOManager(base_dir=self.base_dir)
        return dg.Definitions(
            assets=assets,
            asset_checks=checkpoint_checks(asset) if self.checkpoint_checks else None,
            sensors=sensors,
            resources=resources,
        )

    def _asset_arguments(self) -> dict[str, Any]:
        arguments = {f.name: getattr(self, f.name) for f in _PASSED_ON}
        arguments["source"] = self.source
        arguments["backfill_policy"] = self.backfill_policy
        arguments["budget"] = self.budget
        if self.shards is not None:
            arguments["partitions_def"] = shard_partitions(self.shards)
        return arguments
