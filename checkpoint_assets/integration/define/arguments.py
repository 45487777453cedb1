"""The arguments of the decorators, each declared once as a dataclass field.

- ``CommonArguments`` is what every checkpointed asset takes: the rows, ``RowSettings`` (with
  the engine's defaults) and what goes to Dagster (name, group, owners, ...).
- ``AssetArguments`` adds how ``checkpointed_asset`` calls its function (the rest of
  ``AssetSettings``).
- ``ProviderArguments`` (``provider_asset.py``) adds the provider's.

A decorator takes the fields of its dataclass as keyword arguments. ``keyword_arguments_of``
gives it their signature, so mypy and IDEs know them. Its docstring lists them from their
``DOC``. ``CheckpointedAssetComponent`` derives its YAML attributes from them. A new argument is
one field here, or in ``RowSettings`` or ``AssetSettings`` for a setting.

No ``from __future__ import annotations`` here: the Component reads the fields' types at runtime.
"""

import functools
import inspect
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ParamSpec, TypeVar

import dagster as dg

from checkpoint_assets.engine.fields import DOC, required, setting
from checkpoint_assets.engine.settings import AssetSettings, RowSettings

SourceSpec = str | dg.AssetKey | dg.AssetsDefinition | Sequence[str]
P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, kw_only=True)
class _Rows:
    """Where the rows come from and how they split (first in the signature)."""

    source: SourceSpec = required(
        "The upstream asset with the rows: its key (a/b for a prefix), an AssetKey, a key path "
        "or the AssetsDefinition."
    )
    id_column: str = required("Unique integer or string id of each row.")
    input_columns: Sequence[str] | None = setting(
        None, "The columns the function reads and that fingerprint a row (default: all but the id)."
    )
    partitions_def: dg.PartitionsDefinition | None = setting(
        None, "shard_partitions(n) for n shards (default: one checkpoint)."
    )
    source_partition_mapping: dg.PartitionMapping | None = setting(
        None,
        "Which partitions of a partitioned source each partition reads, e.g. "
        "dagster.AllPartitionMapping() for shards over every partition of a source written a "
        "file or a day at a time (default: Dagster's own rule).",
    )


@dataclass(frozen=True, kw_only=True)
class _ToDagster:
    """What goes to ``dagster.asset`` (last in the signature)."""

    name: str | None = setting(None, "Asset name (default: the function's name).")
    key_prefix: str | Sequence[str] | None = setting(None, "Asset key prefix.")
    group_name: str | None = setting(None, "Asset group.")
    code_version: str | None = setting(
        None, "Change it when results would change: stored results are then refused."
    )
    pool: str | None = setting(None, "Dagster concurrency pool that limits runs of shards.")
    tags: Mapping[str, str] | None = setting(None, "Asset tags.")
    description: str | None = setting(
        None, "Asset description (default: the function's docstring)."
    )
    metadata: Mapping[str, Any] | None = setting(None, "Extra definition metadata of the asset.")
    io_manager_key: str = setting(
        "io_manager", "Resource key of the CheckpointIOManager that stores the checkpoints."
    )
    backfill_policy: dg.BackfillPolicy | None = setting(None, "Dagster backfill policy.")
    owners: Sequence[str] | None = setting(
        None, "Asset owners: emails or team:name, as in dagster.asset."
    )
    kinds: Sequence[str] | None = setting(
        None, "Kinds shown in the UI, added to the package's own (polars, parquet)."
    )
    op_tags: Mapping[str, Any] | None = setting(
        None, "Tags of the step (for run launchers and executors), as in dagster.asset."
    )
    retry_policy: dg.RetryPolicy | None = setting(
        None, "Dagster's step retries. A retried step resumes from its checkpoint."
    )
    automation_condition: dg.AutomationCondition | None = setting(
        None, "When Dagster's automation materializes the asset's partitions."
    )


@dataclass(frozen=True, kw_only=True)
class CommonArguments(_ToDagster, RowSettings, _Rows):
    """The keyword arguments of every checkpointed asset: the rows, their settings and what goes
    to Dagster, in this order; then whether it reuses results by content."""

    reuse: bool | None = setting(
        None,
        "Take results from the result store by content before any call, and add this asset's "
        "results to it (default: the IO manager's reuse_results). For deterministic functions.",
    )


@dataclass(frozen=True, kw_only=True)
class AssetArguments(CommonArguments, AssetSettings):
    """Every keyword argument of ``checkpointed_asset``: the common ones, and how the function
    is called (after the rows' settings)."""


def _arguments_doc(arguments: Any) -> str:
    """The "Args:" lines of a docstring: each field of the dataclass and its ``DOC``."""
    lines = [f"{f.name}: {f.metadata[DOC]}" for f in fields(arguments)]
    return textwrap.indent(
        "\n".join(textwrap.fill(line, 88, subsequent_indent="    ") for line in lines), " " * 8
    )


def keyword_arguments_of(
    arguments: Callable[P, Any],
) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Give the decorated function the keyword arguments of the dataclass ``arguments``.

    The function receives one ``arguments`` instance; its callers (and mypy, IDEs, ``help()``,
    ``inspect.signature``) see the dataclass's fields as keyword arguments, each documented.
    """

    def wrap(build: Callable[..., R]) -> Callable[P, R]:
        @functools.wraps(build)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return build(arguments(*args, **kwargs))

        returns = inspect.signature(build).return_annotation
        signature = inspect.signature(arguments).replace(return_annotation=returns)
        call.__signature__ = signature  # type: ignore[attr-defined]
        call.__doc__ = f"{build.__doc__ or ''}\n    Args:\n{_arguments_doc(arguments)}"
        return call

    return wrap
