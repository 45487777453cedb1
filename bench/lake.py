"""Lake-scale sources: one shard of a large stored source, against a polars scan of its rows.

``python -m bench.lake --rows 8000000 --text-bytes 500 --shards 16`` (``--smoke``: a tiny size)

1. Build: a source of ``rows`` rows (an integer id, ``text_bytes`` characters of hex text) is
   written as raw Parquet in chunks, then materialized through ``CheckpointIOManager`` by an
   asset returning ``pl.scan_parquet`` of it: stored ordered by the shard key of its checkpointed
   downstream, by polars' streaming sink (the build's peak memory is reported too).
2. Each measurement runs in its own process, which reports its wall time and peak RSS
   (``VmHWM``, see ``bench/lake_scan.py``):

   - ``checkpointed``: shard 3 of ``shards`` of a checkpointed asset over that source (a trivial
     function) through ``execute_in_process`` of the Definitions' job, with a fresh checkpoint;
   - ``scan``: ``pl.scan_parquet`` of the same stored file, filtered to the same shard's rows by
     the stored shard key column, collected by the streaming engine (the best a reader can do);
   - ``empty``: the same checkpointed run over a stored source of no rows: the fixed cost of a
     Dagster run (imports, instance, events), paid whatever the size.

Targets (issue 19): peak RSS at most 2x the scan's; wall at most 2x the scan's plus the empty
run's, i.e. ``(checkpointed - empty) / scan <= 2`` (reported for CPU time too, which a busy
machine disturbs less). Everything is under a temporary folder, removed at the end.
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
from typing import Any

import dagster as dg
import numpy as np
import polars as pl
import pyarrow.parquet as pq

from bench.lake_scan import peak_mib
from checkpoint_assets import CheckpointIOManager, checkpointed_asset, shard_partitions
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.scheme import shard_key_column

ID = "id"
TEXT = "text"
SHARD = 3
CHUNK_ROWS = 500_000
MIB = 1024**2
SOURCES = ["lake_source", "empty_source"]  # built together; the first is measured
SMOKE = {"rows": 20_000, "text_bytes": 50, "shards": 4}


def definitions(folder: str, shards: int) -> dg.Definitions:
    """A source over the raw file, a source of no rows, and a checkpointed asset over each."""

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
    }
    lake_scored = checkpointed_asset(source="lake_source", name="lake_scored", **options)(trivial)
    empty_scored = checkpointed_asset(source="empty_source", name="empty_scored", **options)(
        trivial
    )
    store = CheckpointIOManager(base_dir=os.path.join(folder, "store"))
    return dg.Definitions(
        assets=[lake_source, empty_source, lake_scored, empty_scored],
        resources={"io_manager": store},
    )


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


def run_scan(folder: str, shards: int) -> dict[str, Any]:
    """The baseline, in a process that imports polars alone (``bench/lake_scan.py``)."""
    first, end = hashing.shard_key_bounds(SHARD, shards)
    path = os.path.join(folder, "store", "lake_source.parquet")
    bounds = [str(first), "none" if end is None else str(end)]
    return run_child("bench.lake_scan", [path, shard_key_column(ID), *bounds])


def child(kind: str, folder: str, shards: int) -> dict[str, Any]:
    """One Dagster run in this process (``build``, ``checkpointed`` or ``empty``): its wall time,
    rows and peak RSS."""
    started, cpu = time.perf_counter(), time.process_time()
    job = definitions(folder, shards).resolve_implicit_global_asset_job_def()
    partition = shard_partitions(shards).get_partition_keys()[SHARD]
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


def main(rows: int, text_bytes: int, shards: int) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="bench-lake-")
    try:
        raw = os.path.join(folder, "raw.parquet")
        write_raw(raw, rows, text_bytes)
        raw_mib = os.path.getsize(raw) / MIB
        build = run_child("bench.lake", ["--child", "build", folder, str(shards)])
        os.remove(raw)
        stored = os.path.join(folder, "store", "lake_source.parquet")
        groups = pq.read_metadata(stored).num_row_groups
        figures = {"build": build, "raw_mib": raw_mib, "row_groups": groups}
        figures["scan"] = run_scan(folder, shards)
        for kind in ("empty", "checkpointed"):
            figures[kind] = run_child("bench.lake", ["--child", kind, folder, str(shards)])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    scan, empty, ran = figures["scan"], figures["empty"], figures["checkpointed"]
    assert ran["rows"] == scan["rows"], (ran["rows"], scan["rows"])
    figures["rss_ratio"] = ran["peak_mib"] / scan["peak_mib"]
    # The time a shard takes beyond a Dagster run's fixed cost, against the scan's (<= 2).
    for clock in ("seconds", "cpu"):
        figures[f"{clock}_ratio"] = (ran[clock] - empty[clock]) / scan[clock]
    figures["targets_met"] = figures["rss_ratio"] <= 2 and figures["seconds_ratio"] <= 2
    figures["size"] = {"rows": rows, "text_bytes": text_bytes, "shards": shards}
    return figures


def report(figures: dict[str, Any]) -> str:
    lines = [
        f"source: {figures['size']}, raw {figures['raw_mib']:.0f} MiB, "
        f"{figures['row_groups']} row groups"
    ]
    for kind in ("build", "scan", "empty", "checkpointed"):
        f = figures[kind]
        lines.append(
            f"{kind:>13}: {f['seconds']:7.2f} s wall {f['cpu']:7.2f} s CPU "
            f"{f['peak_mib']:8.0f} MiB peak {f['rows']:>10} rows"
        )
    lines.append(f"checkpointed / scan peak RSS: {figures['rss_ratio']:.2f} (target <= 2)")
    lines.append(
        f"(checkpointed - empty run) / scan: wall {figures['seconds_ratio']:.2f} (target <= 2), "
        f"CPU {figures['cpu_ratio']:.2f}; targets met: {figures['targets_met']}"
    )
    return "\n".join(lines)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8_000_000)
    parser.add_argument("--text-bytes", type=int, default=500)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="a tiny size, for the tests")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "FOLDER", "SHARDS"))
    args = parser.parse_args()
    if args.child:
        kind, folder, shards = args.child
        print(json.dumps(child(kind, folder, int(shards))))
        return
    size = (
        SMOKE
        if args.smoke
        else {"rows": args.rows, "text_bytes": args.text_bytes, "shards": args.shards}
    )
    figures = main(**size)
    print(report(figures))
    print(json.dumps(figures))


if __name__ == "__main__":
    cli()
