"""Griffe extension: the signature a decorated function has when it is called.

``checkpointed_asset`` and ``provider_batch_asset`` are written as ``fn(arguments)`` and take the
fields of a dataclass as keyword arguments (``keyword_arguments_of``, which sets their
``__signature__``). Read from the source, their signature box would show that one parameter;
this gives it the keyword arguments that ``inspect.signature`` sees.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

# `dagster._core.definitions.asset_key.AssetKey` is shown as `AssetKey`, `typing.Any` as `Any`.
QUALIFIED = re.compile(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)")


class KeywordArguments(griffe.Extension):
    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        if not any("keyword_arguments_of" in str(d.value) for d in func.decorators):
            return
        module = importlib.import_module(func.module.path)
        signature = inspect.signature(getattr(module, func.name))
        func.parameters = griffe.Parameters(
            *(
                griffe.Parameter(
                    p.name,
                    annotation=_shown(p.annotation),
                    kind=griffe.ParameterKind.keyword_only,
                    default=None if p.default is inspect.Parameter.empty else repr(p.default),
                )
                for p in signature.parameters.values()
            )
        )
        func.returns = _shown(signature.return_annotation)


def _shown(annotation: Any) -> str:
    # A module with `from __future__ import annotations` leaves its fields' annotations as text.
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return QUALIFIED.sub(r"\1", text)
