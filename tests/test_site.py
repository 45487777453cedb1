"""The documentation site as a reader gets it: built once (``mkdocs build --strict``, as
scripts/lint builds it), then read as HTML.

The strict build fails on a broken link or a reference it cannot generate, but not on text that
renders wrong: a placeholder such as ``usage/<col>`` read as an HTML tag cuts the row it is in,
and ``<figures>`` disappears. These tests compare what the code documents with what the pages
show.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import click
import pytest
from pydantic import BaseModel

from checkpoint_assets.engine.fields import DOC

pytestmark = pytest.mark.slow  # the site's build, about 30 s

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
# What a table is made from, and a base class whose fields it leaves out.
DIRECTIVE = re.compile(r"^<!-- (config|arguments): (\S+)(?: - (\S+))? -->$", re.M)
OBJECT = re.compile(r"^::: (checkpoint_assets\.\S+)$", re.M)
PLACEHOLDER = re.compile(r"<[a-z_]+>")
HEADERS = {
    "arguments": ["argument", "type", "default", "meaning"],
    "config": ["key", "type", "default", "meaning"],
}
# The elements MkDocs, Material and mkdocstrings write. A tag outside these is text of the
# page that the browser swallowed.
ELEMENTS = set(
    " ".join(
        [
            "html head body meta title link script style noscript header footer main nav",
            "article aside section div span a p br hr h1 h2 h3 h4 h5 h6 ul ol li dl dt dd",
            "table thead tbody tfoot tr th td caption colgroup col code pre kbd samp var em",
            "strong b i u s small sub sup mark abbr blockquote img svg path g circle rect",
            "polygon line use defs symbol form input label button select option textarea",
            "details summary template iframe picture source figure figcaption time data wbr",
            "del ins q cite dfn",
        ]
    ).split()
)


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", out],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


class _Page(HTMLParser):
    """The text a reader sees on a page, its tables' cells, and the tags it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.tags: set[str] = set()
        self.tables: list[list[list[str]]] = []  # rows of cells, header row first
        self._hidden = 0
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        if tag in ("script", "style"):
            self._hidden += 1
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th") and self.tables and self.tables[-1]:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._hidden -= 1
        elif tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append(plain("".join(self._cell)))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if not self._hidden:
            self.text.append(data)
            if self._cell is not None:
                self._cell.append(data)


def read(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


def plain(text: str) -> str:
    """``text`` as a reader sees it, whatever its markup: no backticks, spaces collapsed."""
    return " ".join(text.replace("`", "").split())


def shown(site: Path, page: str) -> str:
    return plain("".join(read(site / "reference" / page / "index.html").text))


# -- what the code documents ---------------------------------------------------------------
def load(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def documented(kind: str, dotted: str, base: str = "") -> Iterator[tuple[str, str]]:
    """(name, text) of each argument of a dataclass, or field of a model and of the models of
    this package it holds (less those of ``base``), as a reference table shows them."""
    target = load(dotted)
    if kind == "arguments":
        for f in dataclasses.fields(target):
            yield f.name, f.metadata[DOC]
        return
    # A dg Component describes its attributes in its YAML schema.
    schema = target.model().model_fields if hasattr(target, "model") else {}
    inherited = set(load(base).model_fields) if base else set()
    for name, text in _fields(target, schema):
        if name.split(".")[0] not in inherited:
            yield name, text


def _fields(
    model: type[BaseModel], schema: dict[str, Any], prefix: str = ""
) -> Iterator[tuple[str, str]]:
    for name, field in model.model_fields.items():
        text = field.description or getattr(schema.get(name), "description", None) or ""
        yield prefix + name, text
        for sub in (*getattr(field.annotation, "__args__", ()), field.annotation):
            ours = isinstance(sub, type) and sub.__module__.startswith("checkpoint_assets")
            if ours and issubclass(sub, BaseModel):
                yield from _fields(sub, {}, f"{prefix}{name}.")


def reference_pages() -> list[str]:
    return sorted(p.stem for p in REFERENCE.glob("*.md"))


def docstrings(dotted: str) -> Iterator[str]:
    """The docstrings of an object a page renders with ``:::``, and of its public members."""
    target = load(dotted)
    yield inspect.getdoc(target) or ""
    for name, member in vars(target).items() if isinstance(target, type) else []:
        if not name.startswith("_"):
            yield inspect.getdoc(member) or ""


def help_texts(command: click.Command) -> Iterator[str]:
    yield command.help or ""
    for param in command.params:
        yield getattr(param, "help", None) or ""
    for sub in getattr(command, "commands", {}).values():
        yield from help_texts(sub)


# -- the tests -----------------------------------------------------------------------------
@pytest.mark.parametrize("page", reference_pages())
def test_every_documented_argument_and_field_is_shown_whole(site: Path, page: str) -> None:
    """Each table the reference makes from the code (``<!-- arguments: ... -->``,
    ``<!-- config: ... -->``) has a row per argument or field, and that row's meaning is the
    code's text, whole."""
    source = (REFERENCE / f"{page}.md").read_text()
    directives = DIRECTIVE.findall(source)
    made = [
        table[1:]
        for table in read(site / "reference" / page / "index.html").tables
        if table and table[0] in (HEADERS["arguments"], HEADERS["config"])
    ]
    assert len(made) == len(directives), f"reference/{page}: {len(made)} tables"
    cut = []
    for directive, rows in zip(directives, made, strict=True):
        meanings = {row[0]: row[-1] for row in rows}
        for name, doc in documented(*directive):
            if plain(doc) != meanings.get(name):
                cut.append(f"{name}: {meanings.get(name)!r}, not {plain(doc)!r}")
    assert not cut, f"reference/{page}: rows that do not show the code's text: {cut}"


def test_every_placeholder_the_reference_documents_is_shown(site: Path) -> None:
    sources: list[str] = []
    for page in reference_pages():
        markdown = (REFERENCE / f"{page}.md").read_text()
        for directive in DIRECTIVE.findall(markdown):
            sources += [doc for _, doc in documented(*directive)]
        for dotted in OBJECT.findall(markdown):
            sources += list(docstrings(dotted))
    from checkpoint_assets.cli import cli

    sources += list(help_texts(cli))
    placeholders = {p for text in sources for p in PLACEHOLDER.findall(text)}
    assert "<col>" in placeholders  # usage/<col>: the case this test is for
    assert "<figures>" in placeholders
    text = " ".join(shown(site, page) for page in reference_pages())
    missing = sorted(p for p in placeholders if p not in text)
    assert not missing, f"placeholders of the code that no reference page shows: {missing}"


def test_no_page_holds_a_tag_that_is_text(site: Path) -> None:
    found = {
        str(path.relative_to(site)): sorted(read(path).tags - ELEMENTS)
        for path in sorted(site.rglob("*.html"))
    }
    found = {page: tags for page, tags in found.items() if tags}
    assert not found, f"text read as HTML tags (escape it, or put it in backticks): {found}"
