"""One global-resume read in its own process: requests, rows, time and peak memory.

Run by ``bench/reshard.py``; prints one JSON object. Two commands:

- ``shards BASE_DIR FOLDER PATH COUNT INDEXES``: what a shard run with ``global_resume: true`` reads
  before its first call, for each shard of ``INDEXES`` (comma-separated) of ``COUNT``, one after
  the other as separate runs would. ``PATH`` is ``ranges`` (the overlapping checkpoints of earlier
  counts) or ``table`` (the global resume table, scanned for the shard's keys and filtered by
  job, as the asset body does when it falls back to it).
- ``build BASE_DIR FOLDER ROWS COUNT``: write the finished checkpoints (``reshard.build``), so
  the memory it took is given back before anything is measured.
- ``table BASE_DIR FOLDER ALGORITHM``: the ``<asset>_global_resume`` asset: reconcile every
  checkpoint under ``FOLDER`` and store the table as the IO manager does (zstd Parquet, one PUT).
  ``ALGORITHM`` is ``current`` (``write_table``: streamed, keyed) or ``sorted``, the
  implementation it replaced (a sort of the whole table by checkpoint age and flush, then a
  unique), as the baseline.

Peak RSS is the process's high-water mark during the work minus its RSS before it, so it is the
memory the work itself needed (one shard's at most, for ``shards``).
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from typing import Any

import polars as pl
import pyarrow.parquet as pq

from bench import data
from checkpoint_assets.engine.checkpoints import layout
from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.plan import global_resume
from checkpoint_assets.engine.plan.global_resume import JOB
from checkpoint_assets.engine.rows import CURRENT, ERROR, SEQ
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.scheme import Shard, rows_in
from checkpoint_assets.engine.storage import Store, open_store
from checkpoint_assets.integration.store.source import scan

TABLE = ["bench_global_resume"]  # the asset key of the table


def table_path(store: Store) -> str:
    return store.path(layout.output_name(TABLE, None))


def shards(base_dir: str, folder: str, path: str, count: int, indexes: list[int]) -> dict[str, Any]:
    store = open_store(base_dir)
    read = _count_bytes(store)
    fingerprint = hashing.job_fingerprint(data.JOB)
    base_rss = _start_rss()
    rows_read = rows_found = 0
    started = time.perf_counter()
    for index in indexes:
        if path == "ranges":
            found = global_resume.shard_rows(
                store, folder, data.ID, fingerprint, [Shard(index, count)]
            )
            assert found is not None, "every checkpoint is a range shard"
            table, what = found
            rows_read += what.rows_read
        else:  # as the asset body does: a scan of the keyed table, filtered to the shard
            stored = scan(store, table_path(store))
            mine = rows_in(stored, data.ID, [Shard(index, count).key])
            table = mine.filter(pl.col(JOB) == fingerprint).drop(JOB).collect(engine="streaming")
            rows_read += table.height
        rows_found += table.height
        del table
    seconds = time.perf_counter() - started
    return {
        "shards": len(indexes),
        "seconds": seconds,
        "requests": dict(store.requests),
        "bytes_read": read[0],
        "rows_read": rows_read,
        "rows_found": rows_found,
        "peak_rss_bytes": _peak_rss() - base_rss,
    }


def table(base_dir: str, folder: str, algorithm: str) -> dict[str, Any]:
    store = open_store(base_dir)
    base_rss = _start_rss()
    started = time.perf_counter()
    if algorithm == "current":
        with store.put_file(table_path(store)) as local:
            rows, _ = global_resume.write_table(store, folder, data.ID, local)
            size = os.path.getsize(local)
        reconciled = time.perf_counter() - started
    else:
        found = _sorted(store, folder)
        reconciled = time.perf_counter() - started
        buffer = io.BytesIO()
        pq.write_table(found.to_arrow(), buffer, compression="zstd")
        store.put(table_path(store), buffer.getvalue())
        rows, size = found.height, buffer.tell()
    return {
        "seconds": time.perf_counter() - started,
        "reconcile_seconds": reconciled,
        "rows": rows,
        "table_bytes": size,
        "requests": dict(store.requests),
        "peak_rss_bytes": _peak_rss() - base_rss,
    }


def _sorted(store: Store, folder: str) -> pl.DataFrame:
    """The reconcile this package shipped before: every row tagged, one sort, one unique."""
    frames = []
    for order, name in enumerate(global_resume.checkpoint_names(store, folder)):
        checkpoint = Checkpoint(store, name)
        meta = checkpoint.meta_file.read()
        assert meta is not None
        rows = checkpoint.load(data.ID, meta.base_seq).rows
        ok = rows.filter(pl.col(ERROR).is_null()).drop(CURRENT, strict=False)
        frames.append(
            ok.with_columns(
                pl.lit(meta.job_fingerprint).alias(JOB),
                pl.lit(meta.finalized_at or 0.0).alias("__finalized"),
                pl.lit(order).alias("__order"),
            )
        )
    return (
        pl.concat(frames, how="diagonal_relaxed")
        .sort(["__finalized", "__order", SEQ])
        .unique(subset=[data.ID], keep="last", maintain_order=True)
        .drop("__finalized", "__order")
    )


def _count_bytes(store: Store) -> list[int]:
    """Count the bytes ``store`` reads (a one-element list, updated in place)."""
    total = [0]
    get = store.get

    def counted(path: str) -> bytes:
        got = get(path)
        total[0] += len(got)
        return got

    store.get = counted  # type: ignore[method-assign]
    return total


def _start_rss() -> int:
    """The process's RSS now, with its high-water mark reset to it (Linux): importing Dagster
    peaks higher than the work measured here, and would hide it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _peak_rss() -> int:
    return _status("VmHWM")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "build":
        from bench import reshard

        base, where, rows, count = args
        reshard.build(base, where, int(rows), int(count))
        out = {}
    elif command == "shards":
        base, where, how, n, which = args
        out = shards(base, where, how, int(n), [int(i) for i in which.split(",")])
    else:
        out = table(*args)
    print(json.dumps(out))
