"""A lake-scale job end to end: rewrite, every shard, a lazy downstream, global resume, reshard.

``python -m bench.lake_big --rows 10000000 --shards 64 [--sample 8] [--reshard-sample 8]
[--no-single] [--s3] [--folder DIR]``

1. ``raw``: ``rows`` rows (an integer id, ``text_bytes`` characters of hex text) written as
   Parquet in row groups of 65,536 rows (not measured: the lake as it is).
2. ``build``: an asset returning ``pl.scan_parquet`` of it, stored by ``CheckpointIOManager`` in
   the keyed layout (``engine/sharding/keyed.py``): the rewrite's time and peak memory.
3. ``shard``: shards of a checkpointed asset over it (a cheap function), each its own Dagster run,
   one after another in one process whose peak RSS is reset before each (``--sample``: that
   many, spread over the range, the job's time extrapolated, and the steps below, which need
   every shard, skipped); per shard its peak RSS and
   the bytes of the stored source its key range needs (the row groups its statistics overlap:
   what a reader fetches) against its share; on S3 also what its GETs fetched
   (``storage_bytes_read``) against its share.
4. ``report``: a downstream asset taking every shard's result as a ``pl.LazyFrame``: an
   aggregate over all of them (needs every shard: without ``--sample``).
5. ``global``: ``<asset>_global_resume`` over every stored row; ``reshard``: shards of
   ``--reshard`` count with ``global_resume: true``, sampled the same way.
6. ``single`` and ``ranged`` (skipped with ``--no-single``): the first ``RANGED`` shards under
   a fresh checkpoint tag, as one process per shard (what a run per shard costs on a run
   launcher: ``process_seconds``, from the process's start to its end) against one ranged run
   of them all (``BackfillPolicy.multi_run``'s tags), with its peak RSS against the largest
   shard's.

Every step runs in its own process, which reports wall and CPU time and peak RSS (``VmHWM``;
a run of several shards resets it before each, through ``/proc/self/clear_refs``).
``--s3``: the store on a moto S3 server in its own process (the raw file stays on local disk).
Everything is under ``--folder`` (default: a temporary folder), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from typing import Any

import dagster as dg
import numpy as np
import polars as pl
import pyarrow.parquet as pq

from bench.lake_scan import peak_mib
from bench.remote import moto_process
from checkpoint_assets import (
    CheckpointIOManager,
    checkpointed_asset,
    global_resume_asset,
    shard_partitions,
)
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.scheme import shard_key_column
from checkpoint_assets.engine.storage import open_store

ID, TEXT = "id", "text"
RAW_GROUP_ROWS = 1 << 16
MIB = 1024**2
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
RANGED = 8  # shards in one ranged run, against as many runs of one shard each


def definitions(folder: str, shards: int, options: dict[str, Any]) -> dg.Definitions:
    @dg.asset
    def lake_source() -> pl.LazyFrame:
        return pl.scan_parquet(os.path.join(folder, "raw.parquet"))

    @checkpointed_asset(
        source="lake_source",
        id_column=ID,
        partitions_def=shard_partitions(shards),
        checkpoint_interval=1_000_000,
    )
    def lake_scored(batch: pl.DataFrame) -> pl.DataFrame:
        return batch.select(ID, length=pl.col(TEXT).str.len_bytes())

    @dg.asset(ins={"lake_scored": dg.AssetIn()})
    def lake_report(lake_scored: pl.LazyFrame) -> dg.MaterializeResult:
        total = lake_scored.select(pl.len(), pl.col("length").sum()).collect(engine="streaming")
        return dg.MaterializeResult(metadata={"rows": int(total[0, 0]), "sum": int(total[0, 1])})

    base_dir = options.pop("base_dir", os.path.join(folder, "store"))
    store = CheckpointIOManager(base_dir=base_dir, storage_options=options)
    return dg.Definitions(
        assets=[lake_source, lake_scored, lake_report, global_resume_asset(lake_scored)],
        resources={"io_manager": store},
    )


def write_raw(path: str, rows: int, text_bytes: int) -> None:
    """``rows`` rows of random hex text, vectorised, a row group at a time."""
    rng = np.random.default_rng(0)
    writer: pq.ParquetWriter | None = None
    half = (text_bytes + 1) // 2
    for start in range(0, rows, RAW_GROUP_ROWS):
        n = min(RAW_GROUP_ROWS, rows - start)
        raw = np.frombuffer(rng.bytes(n * half), dtype=f"S{half}")
        text = pl.Series(raw).bin.encode("hex").str.slice(0, text_bytes)
        ids = np.arange(start, start + n, dtype=np.int64)
        table = pl.DataFrame({ID: ids, TEXT: text}).to_arrow()
        writer = writer or pq.ParquetWriter(path, table.schema, compression="zstd")
        writer.write_table(table)
    if writer is not None:
        writer.close()


def child(step: str, folder: str, shards: int, arg: str, options: dict[str, Any]) -> list[Any]:
    """Dagster runs in this process, one per shard in ``arg`` (comma-separated indexes) or one
    for the step: each one's wall and CPU time, peak RSS (reset before each) and metadata."""
    job = definitions(folder, shards, options).resolve_implicit_global_asset_job_def()
    asset = {"build": "lake_source", "report": "lake_report", "global": "lake_scored_global_resume"}
    name = asset.get(step, "lake_scored")
    keys = shard_partitions(shards).get_partition_keys()
    partitions = [keys[int(i)] for i in arg.split(",")] if arg else [None]
    config: dict[str, Any] = {
        "reshard": {"global_resume": True},
        "ranged": {"checkpoint_tag": "ranged"},  # fresh checkpoints: computed again
        "single": {"checkpoint_tag": "single"},
    }.get(step, {})
    run_config = {"ops": {"lake_scored": {"config": config}}} if config else {}
    tags = {}
    if step == "ranged":  # one run of the shards first..last, as BackfillPolicy.multi_run makes
        tags = {RANGE_START: partitions[0], RANGE_END: partitions[-1]}
        partitions = [None]
    figures = []
    for partition in partitions:
        reset_peak()
        started, cpu = time.perf_counter(), time.process_time()
        result = job.execute_in_process(
            asset_selection=[dg.AssetKey(name)],
            partition_key=partition,
            run_config=run_config,
            tags=tags,
            instance=dg.DagsterInstance.ephemeral(),
        )
        assert result.success
        events = result.asset_materializations_for_node(name)
        event = events[0]
        wanted = (
            *("rows", "rows_total", "rows_resumed", "rows_computed", "rows_finished", "sum"),
            *("storage_bytes_read", "storage_requests/get", "storage_requests/head"),
        )
        metadata = {k: v.value for k, v in event.metadata.items() if k in wanted}
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        one = {"step": step, "partition": partition, "seconds": seconds, "cpu": cpu}
        figures.append({**one, "peak_mib": peak_mib(), **metadata})
        print(json.dumps(figures[-1]), file=sys.stderr, flush=True)
    return figures


def reset_peak() -> None:
    """Reset this process's ``VmHWM`` to its current RSS (Linux ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def run_child(folder: str, step: str, shards: int, arg: str, options: dict[str, Any]) -> Any:
    command = [sys.executable, "-m", "bench.lake_big", "--child", step, folder, str(shards), arg]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, json.dumps(options)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{step} {arg} failed:\n{done.stderr[-4000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures[-1]["process_seconds"] = time.perf_counter() - started
    print(json.dumps(figures), flush=True)
    return figures if arg else figures[0]


def needed_bytes(path: str, index: int, count: int) -> int:
    """Compressed bytes of the row groups whose shard key statistics overlap the shard."""
    first, end = hashing.shard_key_bounds(index, count)
    meta = pq.read_metadata(path)
    column = meta.schema.names.index(shard_key_column(ID))
    total = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        stats = group.column(column).statistics
        if stats.max >= first and (end is None or stats.min < end):
            total += sum(group.column(c).total_compressed_size for c in range(group.num_columns))
    return total


def sample(count: int, size: int | None) -> list[int]:
    if size is None or size >= count:
        return list(range(count))
    return sorted({round(i * (count - 1) / (size - 1)) for i in range(size)})


def shards_step(
    folder: str, step: str, count: int, picked: list[int], options: dict[str, Any]
) -> dict[str, Any]:
    runs = run_child(folder, step, count, ",".join(map(str, picked)), options)
    seconds = [r["seconds"] for r in runs]
    return {
        "count": count,
        "ran": len(runs),
        "peak_mib_max": max(r["peak_mib"] for r in runs),
        "seconds_mean": sum(seconds) / len(seconds),
        "seconds_sum": sum(seconds),
        "job_seconds_estimate": sum(seconds) / len(seconds) * count,
        "rows_resumed": sum(r.get("rows_resumed", 0) for r in runs),
        "rows_total": sum(r.get("rows_total", 0) for r in runs),
        "runs": runs,
    }


def main(args: argparse.Namespace, folder: str, options: dict[str, Any]) -> dict[str, Any]:
    raw = os.path.join(folder, "raw.parquet")
    started = time.perf_counter()
    write_raw(raw, args.rows, args.text_bytes)
    figures: dict[str, Any] = {"raw_seconds": time.perf_counter() - started}
    figures["raw_mib"] = os.path.getsize(raw) / MIB
    figures["build"] = run_child(folder, "build", args.shards, "", options)
    if not options:
        stored = os.path.join(folder, "store", "lake_source.parquet")
        size = os.path.getsize(stored)
        share = size / args.shards
        ratios = [needed_bytes(stored, i, args.shards) / share for i in range(args.shards)]
        figures["stored_mib"] = size / MIB
        figures["row_groups"] = pq.read_metadata(stored).num_row_groups
        figures["bytes_over_share_max"] = max(ratios)
    else:
        rest = {k: v for k, v in options.items() if k != "base_dir"}
        store = open_store(options["base_dir"], rest)
        size = store.size(store.path("lake_source.parquet"))
        figures["stored_mib"] = size / MIB
    picked = sample(args.shards, args.sample)
    figures["shards"] = shards_step(folder, "shard", args.shards, picked, options)
    if options:  # on S3, what each shard's GETs fetched (on local disk polars reads uncounted)
        read = [r["storage_bytes_read"] / (size / args.shards) for r in figures["shards"]["runs"]]
        figures["shards"]["bytes_read_over_share"] = read
    if args.sample is not None and args.sample < args.shards:
        return figures  # what follows needs every shard's results
    figures["report"] = run_child(folder, "report", args.shards, "", options)
    figures["global"] = run_child(folder, "global", args.shards, "", options)
    picked = sample(args.reshard, args.reshard_sample)
    figures["reshard"] = shards_step(folder, "reshard", args.reshard, picked, options)
    if args.no_single:
        return figures
    # What a run costs beyond its shard's work: RANGED runs of one shard, each its own process
    # (as a run launcher starts them), against one run of RANGED shards.
    figures["single"] = [
        run_child(folder, "single", args.shards, str(i), options) for i in range(RANGED)
    ]
    figures["ranged"] = run_child(folder, "ranged", args.shards, f"0,{RANGED - 1}", options)
    return figures


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--text-bytes", type=int, default=200)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--reshard", type=int, default=48)
    parser.add_argument("--sample", type=int, default=None)
    parser.add_argument("--reshard-sample", type=int, default=None)
    parser.add_argument("--no-single", action="store_true", help="skip runs per shard vs ranged")
    parser.add_argument("--s3", action="store_true")
    parser.add_argument("--folder", default=None)
    parser.add_argument("--child", nargs=5, metavar=("STEP", "FOLDER", "SHARDS", "ARG", "OPTS"))
    args = parser.parse_args()
    if args.child:
        step, folder, shards, arg, options = args.child
        print(json.dumps(child(step, folder, int(shards), arg, json.loads(options))))
        return
    folder = tempfile.mkdtemp(prefix="bench-lake-big-", dir=args.folder)
    os.environ["TMPDIR"] = folder  # the rewrite's bucket files, on the same disk
    try:
        with moto_process() if args.s3 else nullcontext() as server:
            options = {} if server is None else {"base_dir": server[0], **server[1]}
            figures = main(args, folder, options)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    figures["size"] = {k: getattr(args, k) for k in ("rows", "text_bytes", "shards", "reshard")}
    print(json.dumps(figures))


if __name__ == "__main__":
    cli()
