"""Global resume: the finished rows of every checkpoint of an asset, whatever its shard scheme.

After a change of shard count (8 -> 16, 16 -> 4, unpartitioned -> sharded) a row's finished result
may sit in a checkpoint of the old scheme. ``finished_rows`` reads every checkpoint found on storage
under the asset's folder (not only ``range(current n)``), keeps the successful rows, and resolves
each id to one winner: the newest finalized checkpoint, then the newest flush. Each row keeps its
``_input_hash`` and its checkpoint's job fingerprint (``_job``), so a shard imports only rows of its
own job whose input is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from checkpoint_assets.engine.checkpoint import Checkpoint
from checkpoint_assets.engine.layout import names_in
from checkpoint_assets.engine.rows import CURRENT, ERROR, SEQ
from checkpoint_assets.engine.storage import Store

JOB = "_job"  # the job fingerprint of each row's checkpoint, in the global resume table


@dataclass
class Found:
    """What ``finished_rows`` read."""

    checkpoints: list[str] = field(default_factory=list)
    schemes: list[str] = field(default_factory=list)
    rows_read: int = 0


def checkpoint_names(store: Store, folder: str) -> list[str]:
    """Names (relative to the store root) of every checkpoint under ``folder``."""
    return names_in((f.path for f in store.list_recursive(store.path(folder))), store.root)


def finished_rows(store: Store, folder: str, id_column: str) -> tuple[pl.DataFrame, Found]:
    """One successful row per id from every checkpoint under ``folder``."""
    found = Found()
    frames = []
    for order, name in enumerate(checkpoint_names(store, folder)):
        checkpoint = Checkpoint(store, name)
        meta = checkpoint.read_meta()
        if meta is None or meta.id_column != id_column:
            continue
        rows = checkpoint.load(id_column, meta.base_seq).rows
        found.checkpoints.append(checkpoint.url)
        found.schemes.append(meta.scheme.label if meta.scheme else "unknown")
        found.rows_read += rows.height
        if rows.height == 0:
            continue
        ok = rows.filter(pl.col(ERROR).is_null()).drop(CURRENT, strict=False)
        frames.append(
            ok.with_columns(
                pl.lit(meta.job_fingerprint).alias(JOB),
                pl.lit(meta.finalized_at or 0.0).alias("__finalized"),
                pl.lit(order).alias("__order"),
            )
        )
    if not frames:
        return pl.DataFrame(), found
    table = (
        pl.concat(frames, how="diagonal_relaxed")
        .sort(["__finalized", "__order", SEQ])
        .unique(subset=[id_column], keep="last", maintain_order=True)
        .drop("__finalized", "__order")
    )
    return table, found
