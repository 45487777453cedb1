"""Griffe extension: the reStructuredText of the package's docstrings, said in Markdown.

The docstrings are read by ``help()`` and IDEs too, so they keep their ``:func:`name``` roles and
``Example::`` literal blocks; the API reference shows them as code and fenced code blocks.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|meth|attr|mod|exc|data):`~?([^`]+)`")
LITERAL = re.compile(r"^(\s*)(.*?)::\s*$")


class RestructuredText(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)


def markdown(text: str) -> str:
    text = ROLE.sub(r"`\1`", text)
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = LITERAL.match(lines[i])
        if not match or match[2].endswith(":"):
            out.append(lines[i])
            i += 1
            continue
        indent, lead = match[1], match[2]
        out.append(f"{indent}{lead}:" if lead and lead != "Example" else f"{indent}**Example**")
        i += 1
        block: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(indent)):
            block.append(lines[i])
            i += 1
        code = textwrap.dedent("\n".join(block)).strip("\n")
        out += ["", f"{indent}```python", *textwrap.indent(code, indent).splitlines()]
        out += [f"{indent}```", ""]
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())
