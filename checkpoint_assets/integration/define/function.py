"""How a checkpointed function is called: the batch first, then Dagster resources and the context.

``def fn(batch, llm: LLMResource, context)``: every parameter after the batch is a Dagster
resource of that name (its key in ``Definitions(resources=...)``), except one named ``context``,
which receives the asset's execution context. This mirrors ``@dg.asset``. The signature is checked
when the asset is defined, so a mistake fails the code location's load, not a shard hours later.

A first parameter annotated ``dict``, ``dict[str, Any]`` or ``Mapping[str, Any]`` makes it a
per-row function. It gets one row as a dict (the id and the input columns). It returns a dict of
its output columns (see ``engine/calls/batches.py``).
"""

import collections.abc
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dagster as dg

from checkpoint_assets.engine.calls.batches import PerRow
from checkpoint_assets.engine.errors import CheckpointError

_ROW_TYPES = (dict, collections.abc.Mapping)  # what ``typing.get_origin`` says of each spelling
_ROW_NAMES = frozenset({"dict", "Dict", "Mapping"})  # annotations that could not be resolved

CONTEXT = "context"
_RESOURCE_PARAM = "resource_param"  # the marker of dg.ResourceParam[...]


@dataclass(frozen=True)
class Signature:
    """What a checkpointed function takes besides its batch."""

    resources: tuple[str, ...]
    wants_context: bool
    per_row: bool = False  # it takes one row as a dict

    @classmethod
    def of(cls, fn: Callable[..., Any], batch_size: int | None = None) -> "Signature":
        name = getattr(fn, "__name__", repr(fn))
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError) as e:
            raise _error(name, f"its signature cannot be read ({e})") from None
        if not params or params[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            raise _error(name, "it takes no batch: its first parameter must be the batch")
        hints = _hints(fn)
        per_row = _takes_a_row(hints.get(params[0].name, params[0].annotation))
        if per_row and batch_size not in (None, 1):
            raise _error(
                name,
                f"it takes one row (a dict), but batch_size={batch_size} asks for that many rows "
                "per call; leave batch_size unset, or take a pl.DataFrame",
            )
        resources: list[str] = []
        wants_context = False
        for p in params[1:]:
            if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                raise _error(name, f"`{p}`: a checkpointed function takes named parameters only")
            if p.kind is inspect.Parameter.POSITIONAL_ONLY:
                raise _error(name, f"`{p.name}` is positional-only; resources are passed by name")
            if p.name == CONTEXT:
                wants_context = True
                continue
            annotation = hints.get(p.name, p.annotation)
            if annotation in (inspect.Parameter.empty, Any) or _is_resource(annotation):
                resources.append(p.name)
                continue
            raise _error(
                name,
                f"parameter `{p.name}: {_type_name(annotation)}` is neither the execution "
                f"context (name it `{CONTEXT}`) nor a resource (annotate it with a "
                "ConfigurableResource subclass or dg.ResourceParam[...], or leave it "
                "unannotated and provide a resource of that name)",
            )
        return cls(tuple(resources), wants_context, per_row)

    def bind(self, fn: Callable[..., Any], context: dg.AssetExecutionContext) -> Any:
        """``fn`` with its resources and context filled in: a function of the batch alone (or of
        the row, wrapped in :class:`PerRow`)."""
        kwargs: dict[str, Any] = {r: getattr(context.resources, r) for r in self.resources}
        if self.wants_context:
            kwargs[CONTEXT] = context
        call = functools.partial(fn, **kwargs) if kwargs else fn
        return PerRow(call) if self.per_row else call


def _takes_a_row(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return annotation.split("[", 1)[0].rsplit(".", 1)[-1].strip() in _ROW_NAMES
    return (typing.get_origin(annotation) or annotation) in _ROW_TYPES


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:  # names only importable under TYPE_CHECKING: fall back to the raw ones
        return {}


def _is_resource(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(
        annotation, dg.ConfigurableResource | dg.ResourceDefinition | dg.ConfigurableIOManager
    ):
        return True
    return getattr(annotation, "__metadata__", None) == (_RESOURCE_PARAM,)


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation)


def _error(name: str, problem: str) -> CheckpointError:
    return CheckpointError(
        f"The checkpointed function {name}() cannot be called: {problem}.",
        "Write it as `def fn(batch: pl.DataFrame, <resource>: <ResourceClass>, context)` (or "
        "`row: dict[str, Any]` for one row per call): the "
        "batch first, then Dagster resources by their key, and `context` if it needs the "
        "execution context.",
    )
