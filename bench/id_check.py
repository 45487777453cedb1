"""What the whole-source id check costs before a run's shards compute.

``python -m bench.id_check [--rows 16000000] [--shards 16]``

A source of ``rows`` rows (an integer id and a short text) is written twice: as a plain Parquet
file, and stored by ``CheckpointIOManager``'s writer in the keyed layout. Timed, each the best
of ``--repeat``:

- ``plain: check``: ``ShardRows.check_ids`` over a scan of the plain file: every id read, by
  ranges of their shard keys, duplicates and nulls looked for.
- ``keyed: footer``: ``ids_refused`` on the stored file: its footer's statistics, no data.
- baselines in the same run: a polars scan of the plain file's id column (``ids scan``), and
  what a run of one shard of ``shards`` spends reading its rows of the plain source before its
  first call (``one shard's spill``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable

import polars as pl

from checkpoint_assets.engine.storage import open_store
from checkpoint_assets.integration.store.source import ShardRows
from checkpoint_assets.integration.store.stored import ids_refused, store_output


def _best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16_000_000)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-id-check-") as folder:
        plain = os.path.join(folder, "plain.parquet")
        frame = pl.DataFrame({"ticket_id": pl.int_range(args.rows, eager=True)}).with_columns(
            body=pl.format("ticket {}", pl.col("ticket_id"))
        )
        frame.write_parquet(plain, row_group_size=1 << 16)
        store = open_store(folder)
        store_output(store, store.path("keyed.parquet"), frame, ["ticket_id"])
        del frame
        key = f"{args.shards // 2}-of-{args.shards}"

        def spill() -> None:
            with ShardRows(pl.scan_parquet(plain), "ticket_id", [key]):
                pass

        def check() -> None:
            with ShardRows(pl.scan_parquet(plain), "ticket_id", [key]) as rows:
                rows.check_ids()

        spill_s = _best(spill, args.repeat)
        figures = {
            "rows": args.rows,
            "shards": args.shards,
            "ids scan s": _best(
                lambda: pl.scan_parquet(plain).select("ticket_id").collect(), args.repeat
            ),
            "one shard's spill s": spill_s,
            "plain: check s": _best(check, args.repeat) - spill_s,
            "keyed: footer s": _best(
                lambda: ids_refused(store, store.path("keyed.parquet"), "ticket_id"), args.repeat
            ),
        }
        assert ids_refused(store, store.path("keyed.parquet"), "ticket_id") == 0
    figures["plain: check / one shard's spill"] = (
        figures["plain: check s"] / figures["one shard's spill s"]
    )
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
