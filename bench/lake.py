"""Lake-scale sources: one shard of a large stored source, against a polars scan of its rows.

``python -m bench.lake --rows 8000000 --text-bytes 500 --shards 16`` (``--smoke``: a tiny size);
``python -m bench.lake --rows 2000000 --text-bytes 2000 --shards 1``: one shard of 4 GB of text.
``--s3``: the store on a moto S3 server in its own process (``bench.remote.moto_process``).

1. Build: a source of ``rows`` rows (an integer id, ``text_bytes`` characters of hex text) is
   written as raw Parquet in chunks, then materialized through ``CheckpointIOManager`` by an
   asset returning ``pl.scan_parquet`` of it: stored ordered by the shard key of its checkpointed
   downstream, by polars' streaming sink (the build's peak memory is reported too).
2. Each measurement runs in its own process, which reports its wall time and peak RSS
   (``VmHWM``, see ``bench/lake_scan.py``):

   - ``checkpointed``: shard 3 of ``shards`` (the last, with fewer) of a checkpointed asset over
     that source (a trivial function of batches of ``BATCH_ROWS`` rows) through
     ``execute_in_process`` of the Definitions' job, with a fresh checkpoint;
   - ``scan``: ``pl.scan_parquet`` of the same stored file, filtered to the same shard's rows by
     the stored shard key column, collected by the streaming engine (the best a reader can do;
     on S3, polars' own object-store reader over the same server);
   - ``empty``: the same checkpointed run over a stored source of no rows: the fixed cost of a
     Dagster run (imports, instance, events), paid whatever the size.

Then ``reads`` (local store only): the CPU of the shard's two input reads alone, without
Dagster (``engine/plan/inputs.py``), against the scan's: what bounds the shard's CPU.

Targets: peak RSS at most 1.5x the scan's, and under 1 GiB; wall at most 2x the scan's plus the
empty run's, i.e. ``(checkpointed - empty) / scan <= 2`` (reported for CPU time too, which a
busy machine disturbs less). Everything is under a temporary folder, removed at the end.
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
from checkpoint_assets import CheckpointIOManager, checkpointed_asset, shard_partitions
from checkpoint_assets.engine.plan.inputs import prepare
from checkpoint_assets.engine.rows import ATTEMPTS
from checkpoint_assets.engine.settings import Settings
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.scheme import shard_key_column
from checkpoint_assets.engine.storage import open_store
from checkpoint_assets.integration.store.source import ShardRows

ID = "id"
TEXT = "text"
BATCH_ROWS = 1_000  # rows per call: what the function holds, the rest stays in storage
SHARD = 3  # the shard measured (the last one when there are fewer)
CHUNK_ROWS = 500_000
MIB = 1024**2
SOURCES = ["lake_source", "empty_source"]  # built together; the first is measured
SMOKE = {"rows": 20_000, "text_bytes": 50, "shards": 4}


def definitions(folder: str, shards: int, storage: dict[str, Any]) -> dg.Definitions:
    """A source over the raw file, a source of no rows, and a checkpointed asset over each;
    stored under ``storage``'s ``base_dir`` with the rest as storage options (default: local)."""

    @dg.asset
    def lake_source() -> pl.LazyFrame:
        return pl.scan_parquet(os.path.join(folder, "raw.parquet"))

    @dg.asset
    def empty_source() -> pl.DataFrame:
        return pl.DataFrame(schema={ID: pl.Int64, TEXT: pl.String})

    def trivial(batch: pl.DataFrame) -> pl.DataFrame:
        return batch.select(ID, length=pl.col(TEXT).str.len_bytes())

    options: dict[str, Any] = {
        "id_column": ID,
        "partitions_def": shard_partitions(shards),
        "checkpoint_interval": 1_000_000,
        "batch_size": BATCH_ROWS,
    }
    lake_scored = checkpointed_asset(source="lake_source", name="lake_scored", **options)(trivial)
    empty_scored = checkpointed_asset(source="empty_source", name="empty_scored", **options)(
        trivial
    )
    rest = {k: v for k, v in storage.items() if k != "base_dir"}
    base_dir = storage.get("base_dir", os.path.join(folder, "store"))
    store = CheckpointIOManager(base_dir=base_dir, storage_options=rest)
    return dg.Definitions(
        assets=[lake_source, empty_source, lake_scored, empty_scored],
        resources={"io_manager": store},
    )


def measured(shards: int) -> int:
    """The index of the shard measured."""
    return min(SHARD, shards - 1)


def write_raw(path: str, rows: int, text_bytes: int) -> None:
    """``rows`` rows of hex text, written a chunk at a time (bounded memory)."""
    rng = np.random.default_rng(0)
    writer: pq.ParquetWriter | None = None
    for start in range(0, rows, CHUNK_ROWS):
        n = min(CHUNK_ROWS, rows - start)
        raw = rng.integers(0, 256, size=n * ((text_bytes + 1) // 2), dtype=np.uint8).tobytes()
        step = (text_bytes + 1) // 2
        texts = [raw[i * step : (i + 1) * step].hex()[:text_bytes] for i in range(n)]
        chunk = pl.DataFrame({ID: np.arange(start, start + n, dtype=np.int64), TEXT: texts})
        table = chunk.to_arrow()
        writer = writer or pq.ParquetWriter(path, table.schema, compression="zstd")
        writer.write_table(table)
    if writer is not None:
        writer.close()


def run_child(module: str, args: list[str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module} {args[:2]} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_scan(folder: str, shards: int, options: dict[str, Any]) -> dict[str, Any]:
    """The baseline, in a process that imports polars alone (``bench/lake_scan.py``)."""
    first, end = hashing.shard_key_bounds(measured(shards), shards)
    bounds = [str(first), "none" if end is None else str(end)]
    if not options:
        path = os.path.join(folder, "store", "lake_source.parquet")
        return run_child("bench.lake_scan", [path, shard_key_column(ID), *bounds])
    client = options["client_kwargs"]
    polars_options = {
        "aws_endpoint_url": client["endpoint_url"],
        "aws_region": client["region_name"],
        "aws_access_key_id": options["key"],
        "aws_secret_access_key": options["secret"],
        "aws_allow_http": "true",
    }
    path = f"{options['base_dir']}/lake_source.parquet"
    args = [path, shard_key_column(ID), *bounds, json.dumps(polars_options)]
    return run_child("bench.lake_scan", args)


def child(kind: str, folder: str, shards: int, options: dict[str, Any]) -> dict[str, Any]:
    """One Dagster run in this process (``build``, ``checkpointed`` or ``empty``): its wall time,
    rows and peak RSS."""
    started, cpu = time.perf_counter(), time.process_time()
    job = definitions(folder, shards, options).resolve_implicit_global_asset_job_def()
    partition = shard_partitions(shards).get_partition_keys()[measured(shards)]
    selected = {"checkpointed": "lake_scored", "empty": "empty_scored"}
    assets = [selected[kind]] if kind in selected else SOURCES
    result = job.execute_in_process(
        asset_selection=[dg.AssetKey(a) for a in assets],
        partition_key=None if kind == "build" else partition,
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    event = result.asset_materializations_for_node(assets[0])[0]
    rows = event.metadata["rows" if kind == "build" else "rows_total"].value
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"kind": kind, "seconds": seconds, "cpu": cpu, "rows": rows, "peak_mib": peak_mib()}


def reads(folder: str, shards: int) -> dict[str, Any]:
    """The CPU seconds of the shard's input reads alone (local store): one read of its id and
    text a slice at a time, ``prepare`` (that read and every row's hash), and the read of every
    row again as the calls take them (``Prepared.todo``)."""
    path = os.path.join(folder, "store", "lake_source.parquet")
    key = shard_partitions(shards).get_partition_keys()[measured(shards)]
    settings = Settings(id_column=ID, input_columns=(TEXT,))
    figures: dict[str, Any] = {"kind": "reads"}
    with ShardRows(pl.scan_parquet(path), ID, [key]) as shard:
        inputs = shard.of(key)
        cpu = time.process_time()
        figures["rows"] = sum(f.height for f in inputs.slices([ID, TEXT]))
        figures["read"] = time.process_time() - cpu
        cpu = time.process_time()
        prepared = prepare(inputs, settings)
        figures["prepare"] = time.process_time() - cpu
        todo = prepared.keys.with_columns(pl.lit(0, pl.Int32).alias(ATTEMPTS))
        cpu = time.process_time()
        assert sum(f.height for f in prepared.todo(todo, BATCH_ROWS)) == figures["rows"]
        figures["todo"] = time.process_time() - cpu
    return figures


def main(rows: int, text_bytes: int, shards: int, options: dict[str, Any]) -> dict[str, Any]:
    """Build, then measure the scan, the run over no rows and the shard, each in its own
    process (``options``: where the store is, see ``definitions``)."""
    folder = tempfile.mkdtemp(prefix="bench-lake-")
    try:
        raw = os.path.join(folder, "raw.parquet")
        write_raw(raw, rows, text_bytes)
        raw_mib = os.path.getsize(raw) / MIB
        said = json.dumps(options)
        build = run_child("bench.lake", ["--child", "build", folder, str(shards), said])
        os.remove(raw)
        figures = {"build": build, "raw_mib": raw_mib, "row_groups": row_groups(folder, options)}
        figures["scan"] = run_scan(folder, shards, options)
        for kind in ("empty", "checkpointed"):
            args = ["--child", kind, folder, str(shards), said]
            figures[kind] = run_child("bench.lake", args)
        if not options:
            args = ["--child", "reads", folder, str(shards), said]
            figures["reads"] = run_child("bench.lake", args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    scan, empty, ran = figures["scan"], figures["empty"], figures["checkpointed"]
    assert ran["rows"] == scan["rows"], (ran["rows"], scan["rows"])
    figures["rss_ratio"] = ran["peak_mib"] / scan["peak_mib"]
    # The time a shard takes beyond a Dagster run's fixed cost, against the scan's (<= 2).
    for clock in ("seconds", "cpu"):
        figures[f"{clock}_ratio"] = (ran[clock] - empty[clock]) / scan[clock]
    small = ran["peak_mib"] < 1024
    figures["targets_met"] = figures["rss_ratio"] <= 1.5 and small and figures["seconds_ratio"] <= 2
    figures["size"] = {"rows": rows, "text_bytes": text_bytes, "shards": shards}
    figures["store"] = "s3 (moto)" if options else "local"
    return figures


def row_groups(folder: str, options: dict[str, Any]) -> int:
    """The row groups of the stored source."""
    if not options:
        return pq.read_metadata(os.path.join(folder, "store", "lake_source.parquet")).num_row_groups
    rest = {k: v for k, v in options.items() if k != "base_dir"}
    store = open_store(options["base_dir"], rest)
    with store.fs.open(store.path("lake_source.parquet"), "rb") as file:
        return pq.ParquetFile(file).metadata.num_row_groups


def report(figures: dict[str, Any]) -> str:
    lines = [
        f"source: {figures['size']}, raw {figures['raw_mib']:.0f} MiB, "
        f"{figures['row_groups']} row groups, store {figures['store']}"
    ]
    for kind in ("build", "scan", "empty", "checkpointed"):
        f = figures[kind]
        lines.append(
            f"{kind:>13}: {f['seconds']:7.2f} s wall {f['cpu']:7.2f} s CPU "
            f"{f['peak_mib']:8.0f} MiB peak {f['rows']:>10} rows"
        )
    lines.append(
        f"checkpointed / scan peak RSS: {figures['rss_ratio']:.2f} (target <= 1.5; "
        f"and under 1024 MiB)"
    )
    lines.append(
        f"(checkpointed - empty run) / scan: wall {figures['seconds_ratio']:.2f} (target <= 2), "
        f"CPU {figures['cpu_ratio']:.2f}; targets met: {figures['targets_met']}"
    )
    if "reads" in figures:
        f, scan = figures["reads"], figures["scan"]["cpu"]
        lines.append(
            f"input reads alone, CPU / scan's: one read {f['read'] / scan:.2f}, prepare (read "
            f"and hash) {f['prepare'] / scan:.2f}, read again for the calls {f['todo'] / scan:.2f}"
        )
    return "\n".join(lines)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8_000_000)
    parser.add_argument("--text-bytes", type=int, default=500)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="a tiny size, for the tests")
    parser.add_argument("--s3", action="store_true", help="the store on a moto S3 server")
    parser.add_argument("--child", nargs=4, metavar=("KIND", "FOLDER", "SHARDS", "OPTIONS"))
    args = parser.parse_args()
    if args.child:
        kind, folder, shards, options = args.child
        if kind == "reads":
            print(json.dumps(reads(folder, int(shards))))
            return
        print(json.dumps(child(kind, folder, int(shards), json.loads(options))))
        return
    size = (
        SMOKE
        if args.smoke
        else {"rows": args.rows, "text_bytes": args.text_bytes, "shards": args.shards}
    )
    with moto_process() if args.s3 else nullcontext() as server:
        options = {} if server is None else {"base_dir": server[0], **server[1]}
        figures = main(**size, options=options)
    print(report(figures))
    print(json.dumps(figures))


if __name__ == "__main__":
    cli()
