"""Declared fields: a dataclass field's default and its meaning, written together.

The meaning is kept under ``DOC`` in the field's metadata. The decorators' docstrings, the
Component's YAML schema, the run config and the docs' reference tables read it from there. So
each is written once, in the engine's dataclass (``Settings``, ``Budget``, ``Price``).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, TypeVar

DOC = "doc"  # the key of a field's meaning in its metadata
T = TypeVar("T")


def setting(default: T, doc: str) -> T:
    """A field with its default and what it means.

    Typed as its default, as ``dataclasses.field`` is, so that mypy checks the default.
    """
    return field(default=default, metadata={DOC: doc})


def required(doc: str) -> Any:
    """A field without a default, and what it means."""
    return field(metadata={DOC: doc})
