"""Pydantic models made from the engine's dataclasses, for the Component's YAML and run config.

A field's type, default and meaning (``DOC``) are declared once, in the dataclass (``Budget``,
``Price``, ``AssetSettings``). A model made here takes them over. So the Dagster UI, ``dg`` and
the docs' reference tables say what the engine says.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, Field, create_model, model_validator

from checkpoint_assets.engine.fields import DOC

M = TypeVar("M", bound=BaseModel)


def model_of(
    source: type,
    base: type[M],
    *,
    name: str,
    module: str,
    doc: str,
    only: Sequence[str] | None = None,
    types: Mapping[str, Any] | None = None,
    overrides: bool = False,
    check: Callable[[dict[str, Any]], object] | None = None,
) -> type[M]:
    """A model on ``base`` with the fields ``only`` (default: all) of the dataclass ``source``.

    ``types`` replaces a field's type where the model's form differs (a nested model, one
    choice of a union). With ``overrides``, each field is optional and left out means "the
    asset's value" (run config). ``check`` gets the values given and raises ``ValueError`` to
    refuse them: the dataclass's own rules, applied when the model is validated.
    """
    hints = typing.get_type_hints(source)
    every = {f.name: f for f in dataclasses.fields(source)}
    chosen = [every[n] for n in only] if only is not None else list(every.values())
    definitions: dict[str, Any] = {}
    for f in chosen:
        kind = (types or {}).get(f.name, hints[f.name])
        meaning = f.metadata[DOC]
        if overrides:
            described = Field(default=None, description=f"{meaning} Left out: the asset's.")
            definitions[f.name] = (kind | None, described)
        else:
            default = ... if f.default is dataclasses.MISSING else f.default
            definitions[f.name] = (kind, Field(default=default, description=meaning))
    validators: dict[str, Any] = {}
    if check is not None:
        names = [f.name for f in chosen]

        def checked(model: M) -> M:
            assert check is not None
            check(given(model, names))
            return model

        validators["_checked"] = model_validator(mode="after")(checked)
    return create_model(  # type: ignore[no-any-return]
        name,
        __base__=base,
        __module__=module,
        __doc__=doc,
        __validators__=validators,
        **definitions,
    )


def given(model: BaseModel, names: Sequence[str]) -> dict[str, Any]:
    """The values of ``names`` that ``model`` gives (0 and false included; None: left out)."""
    return {n: v for n in names if (v := getattr(model, n)) is not None}
