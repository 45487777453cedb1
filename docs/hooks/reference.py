"""MkDocs hook: the references that are made from the code's own declarations.

A page asks for a table with an HTML comment on a line of its own:

- ``<!-- config: module.Class -->``: the fields of a pydantic model (run config, a resource, the
  IO manager, a Component), with their type, default and description (a Component's from its
  YAML schema); ``<!-- config: module.Class -
  module.Base -->`` leaves out the fields of ``Base``.
- ``<!-- arguments: module.Dataclass -->``: the fields of a dataclass of arguments
  (``checkpointed_asset``'s), with their type, default and ``DOC``.
- ``<!-- metadata: TABLE -->``: the keys of ``checkpoint_assets.integration.metadata.TABLE``
  with their meanings.

Links to files of the repository outside ``docs/`` (``../examples/...``) become links to the
repository's page when mkdocs.yml names one (``repo_url``), else the file's path in the
repository, as code; one to a file that does not exist fails the strict build.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import logging
import re
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

log = logging.getLogger("mkdocs.hooks.reference")
ROOT = Path(__file__).resolve().parents[2]
DIRECTIVE = re.compile(r"^<!-- (config|arguments|metadata): (.+?) -->$", re.M)
OUTSIDE = re.compile(r"\[([^\]]*)\]\((\.\./[^)#\s]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    markdown = DIRECTIVE.sub(lambda m: _table(m[1], m[2].strip()), markdown)
    return OUTSIDE.sub(lambda m: _repository_link(m, page, config), markdown)


def _table(kind: str, what: str) -> str:
    if kind == "metadata":
        from checkpoint_assets.integration import metadata

        rows = [(f"`{k}`", v) for k, v in getattr(metadata, what).items()]
        return _markdown(["key", "meaning"], rows)
    if kind == "arguments":
        return _arguments(_load(what))
    name, _, base = (part.strip() for part in what.partition(" - "))
    model = _load(name)
    inherited = set(_load(base).model_fields) if base else set()
    # A dg Component describes its attributes in its YAML schema, not in its fields.
    schema = model.model().model_fields if hasattr(model, "model") else {}
    rows = []
    for key, field in model.model_fields.items():
        if key not in inherited:
            rows.extend(_field_rows(key, field, getattr(schema.get(key), "description", None)))
    return _markdown(["key", "type", "default", "meaning"], rows)


def _arguments(arguments: Any) -> str:
    from checkpoint_assets.engine.fields import DOC

    hints = typing.get_type_hints(arguments)
    rows = []
    for f in dataclasses.fields(arguments):
        default = "required" if f.default is dataclasses.MISSING else f"`{_plain(f.default)!r}`"
        rows.append((f"`{f.name}`", f"`{_type(hints[f.name])}`", default, _cell(f.metadata[DOC])))
    return _markdown(["argument", "type", "default", "meaning"], rows)


def _field_rows(key: str, field: Any, description: str | None = None) -> list[tuple[str, ...]]:
    """One row per field; a field that is itself a model adds a row per field of it."""
    text = _cell(field.description or description or "")
    row = (f"`{key}`", f"`{_type(field.annotation)}`", _default(field), text)
    nested = [a for a in typing.get_args(field.annotation) or (field.annotation,) if _ours(a)]
    rows = [row]
    for sub in nested:
        for name, sub_field in sub.model_fields.items():
            rows.extend(_field_rows(f"{key}.{name}", sub_field))
    return rows


def _cell(text: str) -> str:
    """``text`` as the text of a Markdown table's cell: on one line, its ``|`` escaped, and a
    placeholder such as ``usage/<col>`` shown as written rather than read as an HTML tag."""
    spans = text.replace("\n", " ").replace("|", "\\|").split("`")
    # Inside a code span (odd pieces) `<` is shown as it is.
    return "`".join(s if i % 2 else s.replace("<", "&lt;") for i, s in enumerate(spans))


def _ours(annotation: Any) -> bool:
    """A model of this package, whose fields are listed under the field's own."""
    return (
        isinstance(annotation, type)
        and issubclass(annotation, BaseModel)
        and annotation.__module__.startswith("checkpoint_assets")
    )


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation)).replace("|", "\\|")


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default is PydanticUndefined else field.default
    return f"`{_plain(value)!r}`"


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _load(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _markdown(header: list[str], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _repository_link(match: re.Match[str], page: Any, config: Any) -> str:
    text, link, anchor = match[1], match[2], match[3] or ""
    source = Path(page.file.abs_src_path).parent
    target = (source / link).resolve()
    docs = Path(config["docs_dir"]).resolve()
    if target.is_relative_to(docs):
        return match[0]  # a page of the site: MkDocs checks it
    if not target.exists() or not target.is_relative_to(ROOT):
        log.warning(f"{page.file.src_path}: the link {link} names no file of the repository")
        return match[0]
    path = target.relative_to(ROOT).as_posix() + ("/" if target.is_dir() else "")
    if not config.get("repo_url"):
        return text if text == f"`{path}`" else f"{text} (`{path}`)"
    kind = "tree" if target.is_dir() else "blob"
    return f"[{text}]({config['repo_url'].rstrip('/')}/{kind}/main/{path}{anchor})"
