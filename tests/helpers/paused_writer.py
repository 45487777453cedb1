"""Child process: a writer whose calls block from one id on, for the test to pause it there.

Usage: ``python paused_writer.py BASE_DIR NAME CALLS_FILE PAUSE_ID ROWS LEASE_SECONDS``

It runs the engine over ``tickets(ROWS)`` into checkpoint ``NAME`` with four calls in flight and
a lease of ``LEASE_SECONDS``, appending each id it calls to ``CALLS_FILE`` when the call starts.
Calls of ids from ``PAUSE_ID`` on sleep ``BLOCK_SECONDS`` (the test pauses the process then), the
others 10 ms. It prints how the run ended: ``finished``, or the error's class and message.
"""

from __future__ import annotations

import sys
import time

import polars as pl

from checkpoint_assets.engine import Checkpoint, CheckpointError, Settings, open_store, prepare, run

BLOCK_SECONDS = 5.0


def main() -> None:
    base_dir, name, calls, pause_id, rows, lease = sys.argv[1:7]
    settings = settings_of(float(lease))

    def fn(batch: pl.DataFrame) -> pl.DataFrame:
        ticket = int(batch.get_column("ticket_id")[0])
        with open(calls, "a") as f:
            f.write(f"{ticket}\n")
        time.sleep(BLOCK_SECONDS if ticket >= int(pause_id) else 0.01)
        return answer(batch)

    checkpoint = Checkpoint(open_store(base_dir), name)
    try:
        run(fn, prepare(tickets(int(rows)), settings), checkpoint, settings, job={"v": 1})
        print("finished", flush=True)
    except CheckpointError as e:
        print(f"{type(e).__name__}: {e}", flush=True)


def settings_of(lease_seconds: float) -> Settings:
    """The settings of this writer and of the one that takes its lock over."""
    return Settings(
        id_column="ticket_id",
        input_columns=("body",),
        min_flush_seconds=0.0,
        progress_seconds=3600.0,
        checkpoint_interval=4,
        batch_size=1,
        max_concurrency=4,
        flush_seconds=0.1,
        lease_seconds=lease_seconds,
    )


def tickets(n: int) -> pl.DataFrame:
    return pl.DataFrame({"ticket_id": range(n), "body": [f"b{i}" for i in range(n)]})


def answer(batch: pl.DataFrame) -> pl.DataFrame:
    return batch.select("ticket_id", route=pl.col("body").str.to_uppercase())


if __name__ == "__main__":
    main()
