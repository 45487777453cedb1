"""A store that fails on purpose: any backend's store, with faults injected per operation.

``faulty(store)`` returns a copy of ``store`` (same filesystem, root and class behaviour) whose
``put``, ``get``, ``list`` and ``delete`` consult its ``faults`` first. A fault matches an
operation and a regular expression over the path, lets ``skip`` matching calls through, then acts
``times`` times: with an ``error``, raises it; without one (``list`` only), answers with what the
first matching listing answered (a stale listing), or, with ``hide``, leaves out the files whose
name matches it (a listing that misses one write). Every listing is recorded in ``listed`` (the
folders, in order), so a test can count them.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from checkpoint_assets.engine.storage import Listing, Store


@dataclass
class StoreFault:
    op: str  # put, get, list, delete
    pattern: str
    error: BaseException | None = None  # raised; None with op "list": a stale listing
    hide: str | None = None  # op "list": leave out these files instead
    times: int = 1
    skip: int = 0
    seen: int = 0
    hits: int = 0
    first: Listing | None = field(default=None, repr=False)


class _Faulty:
    faults: list[StoreFault]
    listed: list[str]

    def _fault(self, op: str, path: str) -> StoreFault | None:
        for fault in self.faults:
            if fault.op == op and re.search(fault.pattern, path):
                fault.seen += 1
                if fault.seen > fault.skip and fault.hits < fault.times:
                    fault.hits += 1
                    return fault
        return None

    def put(self, path: str, data: bytes) -> None:
        fault = self._fault("put", path)
        if fault is not None and fault.error is not None:
            raise fault.error
        super().put(path, data)  # type: ignore[misc]

    def get(self, path: str) -> bytes:
        fault = self._fault("get", path)
        if fault is not None and fault.error is not None:
            raise fault.error
        return super().get(path)  # type: ignore[misc, no-any-return]

    def list(self, folder: str) -> Listing:
        self.listed.append(folder)
        listing: Listing = super().list(folder)  # type: ignore[misc]
        for fault in self.faults:
            stale = fault.op == "list" and fault.error is None and fault.hide is None
            if stale and fault.first is None and re.search(fault.pattern, folder):
                fault.first = listing
                return listing
        fault = self._fault("list", folder)
        if fault is not None and fault.error is not None:
            raise fault.error
        if fault is not None and fault.hide is not None:
            return [f for f in listing if not re.search(fault.hide, f.name)]
        if fault is not None and fault.first is not None:
            return list(fault.first)
        return listing

    def delete(self, paths: Any) -> None:
        paths = list(paths)
        for path in paths:
            fault = self._fault("delete", path)
            if fault is not None and fault.error is not None:
                raise fault.error
        super().delete(paths)  # type: ignore[misc]


def faulty(store: Store, *faults: StoreFault) -> Any:
    """A copy of ``store`` that injects ``faults`` (append more to ``.faults`` later)."""
    out = copy.copy(store)
    out.__class__ = type(f"Faulty{type(store).__name__}", (_Faulty, type(store)), {})
    out.faults = list(faults)
    out.listed = []
    return out
