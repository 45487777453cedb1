"""How a checkpointed function is called: the batch first, then Dagster resources and the context.

``def fn(batch, llm: LLMResource, context)``: every parameter after the batch is a Dagster
resource of that name (its key in ``Definitions(resources=...)``), except one named ``context``,
which receives the asset's execution context. This mirrors ``@dg.asset``. The signature is checked
when the asset is defined, so a mistake fails the code location's load, not a shard hours later.
"""

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dagster as dg

from checkpoint_assets.engine.errors import CheckpointError

CONTEXT = "context"
_RESOURCE_PARAM = "resource_param"  # the marker of dg.ResourceParam[...]


@dataclass(frozen=True)
class Signature:
    """What a checkpointed function takes besides its batch."""

    resources: tuple[str, ...]
    wants_context: bool

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> "Signature":
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
        return cls(tuple(resources), wants_context)

    def bind(self, fn: Callable[..., Any], context: dg.AssetExecutionContext) -> Callable[..., Any]:
        """``fn`` with its resources and context filled in: a function of the batch alone."""
        if not self.resources and not self.wants_context:
            return fn
        kwargs: dict[str, Any] = {r: getattr(context.resources, r) for r in self.resources}
        if self.wants_context:
            kwargs[CONTEXT] = context
        return functools.partial(fn, **kwargs)


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
        "Write it as `def fn(batch: pl.DataFrame, <resource>: <ResourceClass>, context)`: the "
        "batch first, then Dagster resources by their key, and `context` if it needs the "
        "execution context.",
    )
