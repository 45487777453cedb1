"""What a scenario measured, and how the run prints and stores it."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Literal


@dataclass
class Figure:
    """One measured value, with the issue's target when it has one."""

    name: str
    value: float | None
    unit: str = ""
    limit: float | None = None
    op: Literal["<=", ">="] = "<="

    @property
    def met(self) -> bool | None:
        if self.limit is None or self.value is None or math.isnan(self.value):
            return None
        return self.value <= self.limit if self.op == "<=" else self.value >= self.limit


@dataclass
class Result:
    """One scenario: its figures and anything worth keeping beside them."""

    key: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    status: Literal["ok", "skipped", "error"] = "ok"
    note: str = ""

    def add(self, name: str, value: float | None, unit: str = "", **target: Any) -> None:
        self.figures.append(Figure(name, value, unit, **target))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["figures"] = [{**asdict(f), "met": f.met} for f in self.figures]
        return out


def table(results: list[Result]) -> str:
    """The results as a plain-text table, one line per figure."""
    rows = [("scenario", "figure", "value", "target", "")]
    for result in results:
        if result.status != "ok":
            rows.append((result.key, result.status, result.note, "", ""))
            continue
        for f in result.figures:
            target = f"{f.op} {_number(f.limit)} {f.unit}".strip() if f.limit is not None else ""
            met = {True: "ok", False: "MISSED", None: ""}[f.met]
            rows.append((result.key, f.name, f"{_number(f.value)} {f.unit}".strip(), target, met))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """The machine and library versions a run was measured on."""
    import dagster
    import polars
    import pyarrow

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "polars": polars.__version__,
        "pyarrow": pyarrow.__version__,
        "dagster": dagster.__version__,
    }


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")


def _number(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, int) or (float(value).is_integer() and abs(value) >= 100):
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"
