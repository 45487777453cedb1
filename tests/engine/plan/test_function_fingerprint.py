"""The function fingerprint, without Dagster: what counts as a change of the function, and an
engine run that is given one."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import blake3
import polars as pl
import pytest
from helpers.rows import route, tickets

from checkpoint_assets.engine import (
    Checkpoint,
    CheckpointError,
    RunContext,
    Settings,
    open_store,
    prepare,
    run,
)
from checkpoint_assets.engine.plan.function_fingerprint import (
    changes,
    of_function,
    of_parse,
    of_resources,
    parse_changed,
    request_changed,
)

LABEL = "Route this ticket."


def tiny(batch: pl.DataFrame) -> pl.DataFrame:
    """Its fingerprint is written out below."""
    return batch.select(label=pl.lit(LABEL))


def _blake3(text: str) -> str:
    return blake3.blake3(text.encode()).hexdigest()[:32]


def _name(identifier: str) -> list[Any]:
    return ["Name", {"ctx": ["Load", {}], "id": ["str", repr(identifier)]}]


def _attribute(value: list[Any], attr: str) -> list[Any]:
    return ["Attribute", {"attr": ["str", repr(attr)], "ctx": ["Load", {}], "value": value}]


def test_the_fingerprint_is_the_spec_in_bytes() -> None:
    # The spec of ``function_fingerprint.py``, written out for ``tiny``: no line numbers, no
    # None or empty fields, no decorators, name or docstring. A change here changes every
    # recorded fingerprint: every checkpoint's next run would report its function as changed.
    data_frame = _attribute(_name("pl"), "DataFrame")
    lit = ["Call", {"args": [_name("LABEL")], "func": _attribute(_name("pl"), "lit")}]
    label = ["keyword", {"arg": ["str", "'label'"], "value": lit}]
    select = ["Call", {"func": _attribute(_name("batch"), "select"), "keywords": [label]}]
    batch = ["arg", {"annotation": data_frame, "arg": ["str", "'batch'"]}]
    tree = [
        "FunctionDef",
        {
            "args": ["arguments", {"args": [batch]}],
            "body": [["Return", {"value": select}]],
            "name": ["str", "''"],
            "returns": data_frame,
        },
    ]
    canonical = json.dumps(tree, sort_keys=True, separators=(",", ":"))

    assert of_function(tiny) == {
        "code": _blake3(canonical),
        "constant:LABEL": _blake3(json.dumps(repr(LABEL))),
    }


def _defined(source: str) -> Any:
    """A function made by ``exec``: no source to read, so its bytecode is what counts."""
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    return namespace["fn"]


def test_without_source_the_bytecode_counts() -> None:
    one = of_function(_defined("def fn(batch):\n    return batch.head(1)\n"))
    same = of_function(_defined("def fn(batch):\n    return batch.head(1)  # a comment\n"))
    other = of_function(_defined("def fn(batch):\n    return batch.head(2)\n"))

    assert list(one) == ["code"]
    assert one == same
    assert changes(one, other) == ["the function's code"]


def test_wrapped_functions_are_fingerprinted_by_what_they_call() -> None:
    @functools.wraps(route)
    def wrapper(batch: pl.DataFrame) -> pl.DataFrame:
        return route(batch)

    assert of_function(wrapper) == of_function(route)
    assert of_function(functools.partial(route)) == of_function(route)


def test_resources_contribute_their_declared_settings_by_name() -> None:
    class Model:
        def __init__(self, model: str) -> None:
            self.model = model

        def checkpoint_fingerprint(self) -> dict[str, Any]:
            return {"model": self.model, "temperature": 0.0}

    small = of_resources({"llm": Model("small"), "db": object()})
    large = of_resources({"llm": Model("large"), "db": object()})

    assert sorted(small) == ["resource:llm.model", "resource:llm.temperature"]
    assert changes({"code": "a", **small}, {"code": "b", **large}) == [
        "the function's code",
        "the resource setting llm.model",
    ]


@pytest.mark.parametrize(
    "declared",
    [lambda: {"client": object()}, lambda: ["model"], lambda: 1 / 0],
    ids=["not-json", "not-a-mapping", "raises"],
)
def test_a_resource_that_cannot_be_fingerprinted_says_what_to_fix(declared: Any) -> None:
    class Resource:
        checkpoint_fingerprint = staticmethod(declared)

    with pytest.raises(CheckpointError, match="resource 'llm' cannot be fingerprinted") as e:
        of_resources({"llm": Resource()})
    assert "mapping of the request settings" in str(e.value)


def _run(tmp_path: Path, fingerprint: dict[str, str] | None, resume: bool = True) -> Any:
    settings = Settings(id_column="ticket_id", input_columns=("body",), resume=resume)
    checkpoint = Checkpoint(open_store(str(tmp_path)), "job")
    inputs = prepare(tickets(8), settings)
    _, stats = run(
        route,
        inputs,
        checkpoint,
        settings,
        job={},
        context=RunContext(function_fingerprint=fingerprint),
    )
    return stats


def test_an_engine_run_reports_a_changed_fingerprint_and_records_the_new_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _run(tmp_path, {"code": "a", "resource:llm.model": "m1"})

    with caplog.at_level("WARNING", logger="checkpoint_assets"):
        changed = _run(tmp_path, {"code": "a", "resource:llm.model": "m2"})

    assert changed.function_changed == ["the resource setting llm.model"]
    assert "the function changed since its stored results were computed" in caplog.text
    meta = json.loads((tmp_path / "job.parquet.meta.json").read_bytes())
    assert meta["function_fingerprint"] == {"code": "a", "resource:llm.model": "m2"}
    assert _run(tmp_path, {"code": "a", "resource:llm.model": "m2"}).function_changed == []
    # A run given no fingerprint compares nothing and keeps the recorded one.
    assert _run(tmp_path, None).function_changed == []
    assert _run(tmp_path, {"code": "b", "resource:llm.model": "m2"}).function_changed == [
        "the function's code"
    ]


def test_a_run_that_reuses_nothing_is_quiet(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _run(tmp_path, {"code": "a"})
    caplog.set_level(logging.WARNING, logger="checkpoint_assets")

    stats = _run(tmp_path, {"code": "b"}, resume=False)

    assert stats.function_changed == []
    assert caplog.text == ""


def _request(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["body"]}]}


def _request_with_a_prompt(row: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": LABEL + row["body"]}]}


def _parse(body: dict[str, Any]) -> dict[str, Any]:
    return {"answer": body["text"]}


def _parse_upper(body: dict[str, Any]) -> dict[str, Any]:
    return {"answer": body["text"].upper()}


def _request_parse(request: Any, parse: Any) -> dict[str, str]:
    return of_function(request) | of_parse(parse)


def test_a_changed_parse_is_told_from_a_changed_request() -> None:
    recorded = _request_parse(_request, _parse)
    parse_only = _request_parse(_request, _parse_upper)
    assert changes(recorded, parse_only) == ["parse()'s code (no call needed)"]
    assert parse_changed(recorded, parse_only) and not request_changed(recorded, parse_only)
    request_only = _request_parse(_request_with_a_prompt, _parse)
    assert changes(recorded, request_only) == [
        "request()'s code (calls needed)",
        "request()'s constant LABEL (calls needed)",
    ]
    assert request_changed(recorded, request_only) and not parse_changed(recorded, request_only)
    assert changes(recorded, recorded) == []


def test_a_fingerprint_that_records_parse_as_one_constant_reads_as_its_parse_part() -> None:
    # How a checkpoint from before the 0.1.0 release recorded a request/parse job: parse's parts
    # joined, one constant.
    joined = ",".join(f"{k}={v}" for k, v in sorted(of_function(_parse).items()))
    recorded = of_function(_request) | {"constant:parse": joined}
    assert changes(recorded, _request_parse(_request, _parse)) == []
    changed = _request_parse(_request, _parse_upper)
    assert parse_changed(recorded, changed) and not request_changed(recorded, changed)
    assert changes(recorded, changed) == ["parse()'s code (no call needed)"]
