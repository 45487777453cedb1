"""Declared fields: a dataclass field's default and its meaning, written together.

The meaning is kept under ``DOC`` in the field's metadata. The decorators' docstrings, the
Component's YAML schema, the run config and the docs' reference tables read it from there. So
each is written once, in the engine's dataclass (``Settings``, ``Budget``, ``Price``).
"""

from __future__ import annotations

from dataclasses import field, fields
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


def doc_of(cls: type, name: str) -> str:
    """The meaning of the field ``name`` of the dataclass ``cls``."""
    meaning: str = next(f for f in fields(cls) if f.name == name).metadata[DOC]
    return meaning
