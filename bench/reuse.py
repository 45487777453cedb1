"""The result store's lookup at scale: bytes read and time for one shard of 16.

``python -m bench.reuse [--rows 10000000] [--shards 16] [--dir PATH]`` stores ``--rows`` results
(a ~40-character ``route`` and two token counts each) in a result store on local disk, written
in chunks of a million rows as shards add them, then merged as ``checkpoint-assets clean
--results`` merges them. For shard 0 it measures, in this one process:

- ``lookup``: ``ResultStore.lookup`` of the shard's keys (every one of them stored, under the
  same ids), as a run does before its first call: bytes its GETs fetched, wall and CPU time;
- ``miss``: the same for as many new rows of shard 0, none of them stored;
- ``baseline``: a polars scan of the same rows' checkpoint (their merged file, written by the
  engine): the file's bytes, wall and CPU time.

It prints one JSON object: ``bytes_ratio`` is the lookup's bytes over the baseline's,
``results_share_ratio`` over the stored bytes of the results it took (the store's bytes times
the shard's share of its rows). The keys' hashing (``prepare``) is in neither figure.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import polars as pl

from checkpoint_assets.engine import Checkpoint, Settings, open_store, prepare, run
from checkpoint_assets.engine.plan.inputs import CONTENT_LO, Prepared
from checkpoint_assets.engine.plan.resume import DEDUPE_KEY
from checkpoint_assets.engine.reuse import layout, upkeep
from checkpoint_assets.engine.reuse.store import ResultStore
from checkpoint_assets.engine.sharding import hashing

CHUNK = 1_000_000
FUNCTION = {"code": "bench"}
JOB = {"input_columns": ["body"]}
SCOPE = layout.scope(FUNCTION, JOB)


def rows(first: int, n: int) -> pl.DataFrame:
    ids = pl.int_range(first, first + n, eager=True).alias("ticket_id")
    body = pl.format("ticket {} about a delayed parcel", ids)
    return pl.select(ids, body.alias("body"))


def results(batch: pl.DataFrame) -> pl.DataFrame:
    return batch.select(
        "ticket_id",
        route=pl.col("body").str.to_uppercase(),
        input_tokens=pl.col("body").str.len_chars(),
        output_tokens=pl.lit(12, pl.Int64),
    )


def fill(store: ResultStore, total: int) -> None:
    """``total`` results, a million at a time (as shards add them), then merged."""
    for first in range(0, total, CHUNK):
        chunk = rows(first, min(CHUNK, total - first))
        hi, lo = hashing.content_keys(chunk, ["body"])
        keys = pl.DataFrame({"hi": hi, "lo": lo}, schema={"hi": pl.UInt64, "lo": pl.UInt64})
        where = chunk.select(layout.id_key("ticket_id", pl.Int64))
        stored = keys.select(layout.stored_keys("hi", "lo")).hstack(
            [*where.get_columns(), *results(chunk).drop("ticket_id").get_columns()]
        )
        store.add(SCOPE, stored)
    upkeep.merge(store, store.files())


def _keys(inputs: Prepared) -> pl.DataFrame:
    """The stored keys and id keys of a shard's rows, as a run looks them up."""
    where = layout.id_key("ticket_id", pl.Int64)
    return inputs.keys.select(*layout.stored_keys(DEDUPE_KEY, CONTENT_LO), where)


def timed(fn: Any) -> tuple[Any, float, float]:
    started, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - started, time.process_time() - cpu


def main(total: int, shards: int, folder: str) -> dict[str, Any]:
    store = open_store(folder)
    result_store = ResultStore(store, store.path(layout.FOLDER))
    _, fill_seconds, _ = timed(lambda: fill(result_store, total))
    everything = rows(0, total)
    mine = everything.filter(
        pl.Series(hashing.shard_of(everything.get_column("ticket_id"), shards) == 0)
    )
    settings = Settings(
        "ticket_id",
        input_columns=("body",),
        checkpoint_interval=1 << 17,
        batch_size=1 << 16,
        progress_seconds=3600.0,
    )
    inputs = prepare(mine, settings, content=True)
    checkpoint = Checkpoint(store, "bench/default/00")
    run(results, inputs, checkpoint, settings, job=JOB)
    keys = _keys(inputs)

    before = store.usage()
    found, seconds, cpu = timed(lambda: result_store.lookup(SCOPE, keys))
    read = store.usage().since(before)
    new = rows(total, total)  # never stored: the shard's share of as many new rows
    new = new.filter(pl.Series(hashing.shard_of(new.get_column("ticket_id"), shards) == 0))
    missing = _keys(prepare(new, settings, content=True))
    before = store.usage()
    none, miss_seconds, miss_cpu = timed(lambda: result_store.lookup(SCOPE, missing))
    miss = store.usage().since(before)
    assert none.height == 0
    merged = checkpoint.files.merged
    scanned, base_seconds, base_cpu = timed(lambda: pl.scan_parquet(merged).collect())
    assert found.height == mine.height == scanned.height
    stored_bytes = sum(f.size for f in result_store.files(SCOPE))
    return {
        "stored_results": total,
        "store_bytes": stored_bytes,
        "store_files": len(result_store.files(SCOPE)),
        "fill_seconds": round(fill_seconds, 1),
        "shard_rows": mine.height,
        "lookup": {
            "bytes": read.bytes_read,
            "gets": read.requests.get("GET", 0),
            "seconds": round(seconds, 3),
            "cpu": round(cpu, 3),
        },
        "miss": {
            "rows": missing.height,
            "bytes": miss.bytes_read,
            "seconds": round(miss_seconds, 3),
            "cpu": round(miss_cpu, 3),
        },
        "baseline": {
            "bytes": os.path.getsize(merged),
            "seconds": round(base_seconds, 3),
            "cpu": round(base_cpu, 3),
        },
        "bytes_ratio": round(read.bytes_read / os.path.getsize(merged), 2),
        "results_share_ratio": round(read.bytes_read / (stored_bytes * mine.height / total), 2),
        "cpu_ratio": round(cpu / max(base_cpu, 1e-9), 2),
        "store_share_read": round(read.bytes_read / stored_bytes, 3),
        "shard_share": round(1 / shards, 3),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    a = parser.parse_args()
    if a.dir:
        print(json.dumps(main(a.rows, a.shards, a.dir), indent=2))
    else:
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(main(a.rows, a.shards, folder), indent=2))
