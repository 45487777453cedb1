"""The baseline of ``bench/lake.py``, in its own process with nothing but polars imported.

``python -m bench.lake_scan PATH COLUMN FIRST END [OPTIONS]``: ``pl.scan_parquet`` of the stored
source, filtered to the shard's keys ``[FIRST, END)`` on the stored shard key column (``END``
"none" for the last shard), collected by the streaming engine; prints one JSON object (wall and
CPU time, rows, peak RSS). ``OPTIONS``: polars' storage options as JSON, for a path on S3.

Peak RSS is the process's ``VmHWM`` (Linux), the high-water mark of its own memory since it
started: ``getrusage``'s ``ru_maxrss`` keeps the parent's RSS at the fork that started the child.
"""

from __future__ import annotations

import json
import sys
import time

import polars as pl


def main(
    path: str, column: str, first: int, end: int | None, options: dict[str, str] | None = None
) -> dict[str, float]:
    started, cpu = time.perf_counter(), time.process_time()
    key = pl.col(column)
    keep = key >= first if end is None else (key >= first) & (key < end)
    scan = pl.scan_parquet(path, storage_options=options)
    rows = scan.filter(keep).collect(engine="streaming").height
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"kind": "scan", "seconds": seconds, "cpu": cpu, "rows": rows, "peak_mib": peak_mib()}


def peak_mib() -> float:
    """This process's peak RSS in MiB (``VmHWM`` in ``/proc/self/status``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (peak RSS is read on Linux only)")


if __name__ == "__main__":
    path, column, first, end = sys.argv[1:5]
    options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    print(json.dumps(main(path, column, int(first), None if end == "none" else int(end), options)))
