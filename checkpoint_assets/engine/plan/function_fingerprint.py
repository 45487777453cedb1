"""The fingerprint of a checkpointed function: its code and the request settings of its resources.

A checkpoint records it in its meta (``function_fingerprint``). A run whose function no longer
matches it, under the same job (same code version), says so (``opening.py``). It is a mapping of
named parts, each a 32-hex-digit BLAKE3 digest, so a change can be named:

- ``code``: the function's syntax tree, parsed from its source, as canonical JSON (``_tree``).
  Its decorators, its name and every docstring inside it are removed. Each node is
  ``[type, {field: value}]``, each non-node value ``[type, repr]``. Nodes carry no line numbers
  and no fields that are None or empty: Python versions disagree on printing those. Comments,
  blank lines, formatting and docstrings do not count. Without readable source (a function made
  by ``exec``, a frozen app), it is the bytecode instead. That is ``co_code``, ``co_names`` and
  ``co_consts``, recursively into nested code objects; it changes with the Python version.
- ``constant:NAME``: a module-level constant or closure variable the function names, such as a
  prompt kept in ``PROMPT = "..."``. It counts str, bytes, numbers, bools, None, and tuples of
  them, by ``repr``. Helper functions it calls are not followed.
- ``resource:KEY.SETTING``: each entry of ``checkpoint_fingerprint()`` of a resource the function
  takes (model, temperature, never secrets), as canonical JSON.
- ``parse:PART`` (request/parse jobs): the parts of ``parse``'s own fingerprint, ``parse:code``
  and ``parse:constant:NAME``. The parts above are then the request's: what changes the answers.
  A change of the parse part alone needs no call (``parse_changed``): the stored answers are
  parsed again (``providers/answers.py``). A checkpoint written before the 0.1.0 release records
  ``parse`` as one part, ``constant:parse``; ``changes`` reads it as the parse part.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import textwrap
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import blake3

from checkpoint_assets.engine.errors import CheckpointError

CODE = "code"
CONSTANT = "constant:"
RESOURCE = "resource:"
PARSE = "parse:"
_ONE_PART_PARSE = CONSTANT + "parse"  # how parse was recorded before 0.1.0 (module docstring)
_PLAIN = (str, bytes, int, float, complex, bool, type(None))
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def of_function(fn: Callable[..., Any]) -> dict[str, str]:
    """The parts of ``fn``'s fingerprint known when it is defined: its code and constants."""
    function = _function_of(fn)
    if function is None:
        return {}
    parts = {CODE: _digest(_source_tree(function) or _bytecode(function.__code__))}
    for name, value in sorted(_constants(function).items()):
        parts[CONSTANT + name] = _digest(repr(value))
    return parts


def of_parse(parse: Callable[..., Any]) -> dict[str, str]:
    """The parse part of a request/parse job's fingerprint (see the module docstring)."""
    return {PARSE + name: value for name, value in of_function(parse).items()}


def of_resources(resources: Mapping[str, object]) -> dict[str, str]:
    """The parts contributed by resources with a ``checkpoint_fingerprint()`` method."""
    parts: dict[str, str] = {}
    for key, resource in sorted(resources.items()):
        declared = getattr(resource, "checkpoint_fingerprint", None)
        if not callable(declared):
            continue
        try:
            for setting, value in dict(declared()).items():
                parts[f"{RESOURCE}{key}.{setting}"] = _digest(value)
        except Exception as e:
            raise CheckpointError(
                f"The resource {key!r} cannot be fingerprinted: its checkpoint_fingerprint() "
                f"failed or returned something else than settings ({type(e).__name__}: {e}).",
                "Make it return a mapping of the request settings that change results (model, "
                "temperature, ...) to JSON values: strings, numbers, booleans, lists, mappings.",
            ) from e
    return parts


def changes(recorded: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """What differs between two fingerprints, in words (empty: the same function). For a
    request/parse job each says whether it is the request's (calls needed) or parse's (none)."""
    names = _changed(recorded, current)
    split = any(k.startswith(PARSE) for k in current)
    return [_describe(k, split) for k in sorted(names, key=lambda k: (_is_parse(k), k != CODE, k))]


def parse_changed(recorded: Mapping[str, str], current: Mapping[str, str]) -> bool:
    """Whether the parse part of a request/parse job differs (its request part may too)."""
    return any(_is_parse(k) for k in _changed(recorded, current))


def request_changed(recorded: Mapping[str, str], current: Mapping[str, str]) -> bool:
    """Whether anything but the parse part differs: the answers may differ."""
    return any(not _is_parse(k) for k in _changed(recorded, current))


def request_part(fingerprint: Mapping[str, str]) -> dict[str, str]:
    """The parts of ``fingerprint`` that change the answers: all but the parse part."""
    return {k: v for k, v in fingerprint.items() if not _is_parse(k)}


def _changed(recorded: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    recorded = _as_split(recorded, current)
    return [k for k in set(recorded) | set(current) if recorded.get(k) != current.get(k)]


def _as_split(recorded: Mapping[str, str], current: Mapping[str, str]) -> Mapping[str, str]:
    """``recorded`` with a one-part parse (before 0.1.0: its parts' digests joined) as ``current``'s
    parse parts: equal to them when it joins the same digests, else all changed (which one is
    unknown)."""
    one = recorded.get(_ONE_PART_PARSE)
    parts = {k: v for k, v in current.items() if k.startswith(PARSE)}
    if one is None or not parts:
        return recorded
    rest = {k: v for k, v in recorded.items() if k != _ONE_PART_PARSE}
    own = sorted((k.removeprefix(PARSE), v) for k, v in parts.items())
    if one == ",".join(f"{k}={v}" for k, v in own):
        return rest | parts
    return rest | dict.fromkeys(parts, "")


def _is_parse(part: str) -> bool:
    return part.startswith(PARSE) or part == _ONE_PART_PARSE


def _describe(part: str, split: bool) -> str:
    if _is_parse(part):
        inner = part.removeprefix(PARSE)
        what = "code" if inner == CODE else f"constant {inner.removeprefix(CONSTANT)}"
        return f"parse()'s {what} (no call needed)"
    if part.startswith(RESOURCE):
        said = f"the resource setting {part.removeprefix(RESOURCE)}"
    elif part == CODE:
        said = "request()'s code" if split else "the function's code"
    else:
        name = part.removeprefix(CONSTANT)
        said = f"request()'s constant {name}" if split else f"the constant {name}"
    return f"{said} (calls needed)" if split else said


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return blake3.blake3(text.encode()).hexdigest()[:32]


def _function_of(fn: Callable[..., Any]) -> types.FunctionType | None:
    """The Python function behind ``fn`` (unwrapped; a partial's function; a callable object's
    ``__call__``), or None."""
    fn = inspect.unwrap(fn)
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    if not isinstance(fn, types.FunctionType):
        call = inspect.getattr_static(type(fn), "__call__", None)  # the function, not bound
        return call if isinstance(call, types.FunctionType) else None
    return fn


def _source_tree(fn: types.FunctionType) -> Any:
    """The canonical syntax tree of ``fn`` (see the module docstring), or None without source."""
    try:
        module = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = module.body[0] if module.body else None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None  # a lambda: its source line holds more than the function
    node.decorator_list = []
    node.name = ""
    for inner in ast.walk(node):
        if isinstance(inner, _DEFS) and ast.get_docstring(inner, clean=False) is not None:
            inner.body = inner.body[1:]
    return _tree(node)


def _tree(value: Any) -> Any:
    if isinstance(value, ast.AST):
        fields = {k: _tree(v) for k, v in ast.iter_fields(value) if v is not None and v != []}
        return [type(value).__name__, fields]
    if isinstance(value, list):
        return [_tree(v) for v in value]
    return [type(value).__name__, repr(value)]


def _bytecode(code: types.CodeType) -> Any:
    consts = [_bytecode(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return [code.co_code.hex(), list(code.co_names), consts]


def _constants(fn: types.FunctionType) -> dict[str, object]:
    """Plain-data globals and closure variables that ``fn`` (or code nested in it) names."""
    found: dict[str, object] = {}
    for name in {n for code in _codes(fn.__code__) for n in code.co_names}:
        if name in fn.__globals__ and _is_plain(fn.__globals__[name]):
            found[name] = fn.__globals__[name]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            value = cell.cell_contents
        except ValueError:  # not assigned yet
            continue
        if _is_plain(value):
            found[name] = value
    return found


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _is_plain(value: object) -> bool:
    if isinstance(value, tuple):
        return all(_is_plain(v) for v in value)
    return isinstance(value, _PLAIN)
