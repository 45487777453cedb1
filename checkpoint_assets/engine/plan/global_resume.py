"""Global resume: finished rows of other checkpoints of an asset, whatever their shard scheme.

The shard count may change: 8 -> 16, 16 -> 4, unpartitioned -> sharded. A row's finished result
may then sit in a checkpoint of the old scheme. Two ways to find it:

- ``shard_rows``, for a run of range shards. Every shard is one contiguous range of the hash
  space. So a shard of the new count reads only the checkpoints of each earlier count whose
  ranges overlap its own: at most ``ceil(n_old / n_new) + 1`` of them. It finds them by their
  names, confirms them by the scheme their meta records, and keeps only the rows in its own
  range. It answers None when storage holds checkpoints it cannot narrow down that way:
  unpartitioned ones, other partition keys, or shards written by the mod rule. (``h % n``
  spreads every old shard over every new one.)
- ``write_table``, the global resume table of one checkpoint tag. It holds every checkpoint
  found in the tag's folder, not only ``range(current n)``. That serves the cases above, and
  reports what each scheme holds. It is written in the keyed layout (``keyed.py``), a checkpoint
  at a time, so a shard's lookup reads only its own row groups. Tags never mix: each has its own
  table (``tags`` lists those on storage).

Both keep the successful rows and resolve each id to one winner: the newest finalized checkpoint,
then the newest flush. Each row keeps its ``_input_hash``, so a shard imports only rows whose input
is unchanged. The table also keeps each row's job fingerprint (``_job``). ``shard_rows`` reads
only checkpoints of the run's own job. Both keep the function fingerprint its checkpoint recorded
(``_function``, JSON; null when none was). So a shard that imports rows can say when another
function computed them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.layout import (
    UNPARTITIONED,
    asset_folder,
    decode,
    names_in,
    split_name,
)
from checkpoint_assets.engine.checkpoints.meta import Meta
from checkpoint_assets.engine.rows import CURRENT, ERROR
from checkpoint_assets.engine.sharding import hashing
from checkpoint_assets.engine.sharding.keyed import write_keyed
from checkpoint_assets.engine.sharding.scheme import RANGE, Shard, shard_key_column
from checkpoint_assets.engine.storage import Store

_ORDER = "_order"  # the checkpoint's place by finalization, while the table is written
JOB = "_job"  # the job fingerprint of each row's checkpoint, in the global resume table
FUNCTION = "_function"  # the function fingerprint its checkpoint recorded, as JSON (or null)


@dataclass
class Found:
    """What a global resume read."""

    checkpoints: list[str] = field(default_factory=list)
    schemes: list[str] = field(default_factory=list)
    rows_read: int = 0


def checkpoint_names(store: Store, folder: str) -> list[str]:
    """Names (relative to the store root) of the checkpoints in ``folder``, one tag's folder.

    Those of another asset whose key continues the path are left out (``a`` and ``a/default``).
    """
    return _names(store, folder, folder.count("/") + 1)


def tags(store: Store, asset_path: Sequence[str]) -> list[str]:
    """The checkpoint tags under which the asset ``asset_path`` has checkpoints on storage."""
    folder = asset_folder(asset_path)
    return sorted({decode(n.split("/")[-2]) for n in _names(store, folder, folder.count("/") + 2)})


def _names(store: Store, folder: str, slashes: int) -> list[str]:
    names = names_in((f.path for f in store.list_recursive(store.path(folder))), store.root)
    return [n for n in names if n.count("/") == slashes]


def write_table(store: Store, folder: str, id_column: str, path: str) -> tuple[int, Found]:
    """Write the global table of one tag's folder to the local file ``path``.

    It holds one successful row per id from every checkpoint in ``folder``. It is in the keyed
    layout of ``id_column``, so a shard's lookup reads only its row groups. Rows are streamed a
    row group of a checkpoint at a time (``_finished``) through the bounded writer of
    ``keyed.py``. So memory follows neither the table nor its largest checkpoint. Returns the
    rows written.
    """
    found = Found()
    metas: list[tuple[Checkpoint, Meta]] = []
    for name in checkpoint_names(store, folder):
        checkpoint = Checkpoint(store, name)
        meta = checkpoint.meta_file.read()
        if meta is not None and meta.id_column == id_column:
            metas.append((checkpoint, meta))
    metas.sort(key=lambda m: m[1].finalized_at or 0.0)  # oldest first: the newest wins
    key = shard_key_column(id_column)

    def batches() -> Iterator[pl.DataFrame]:
        for order, (checkpoint, meta) in enumerate(metas):
            for rows in _finished(checkpoint, meta, found):
                # Categorical: one fingerprint per checkpoint, 4 bytes a row, not a 32-byte text.
                yield rows.with_columns(
                    pl.lit(meta.job_fingerprint, pl.Categorical).alias(JOB),
                    hashing.shard_key(id_column, rows.schema[id_column]).alias(key),
                    pl.lit(order, pl.Int32).alias(_ORDER),
                )

    newest = _newest(id_column, [checkpoint for checkpoint, _ in metas])
    rows = write_keyed(batches(), key, path, pl.Schema(), newest)
    return rows, found


def _newest(id_column: str, by_order: list[Checkpoint]) -> Callable[[pl.DataFrame], pl.DataFrame]:
    """One row per id of a bucket: that of the newest finalized checkpoint (``by_order``: the
    checkpoints by ``_ORDER``). Ids are unique within each one. One that is not is corrupt,
    said as ``load`` says it. (Its merged file was read a row group at a time, unchecked.)
    """

    def resolve(rows: pl.DataFrame) -> pl.DataFrame:
        rows = rows.sort(_ORDER, maintain_order=True)
        ids = rows.get_column(id_column)
        if ids.n_unique() != rows.height:
            twice = rows.select(id_column, _ORDER).is_duplicated()
            if twice.any():
                order = int(rows.filter(twice).get_column(_ORDER)[0])
                checkpoint = by_order[order]
                mine = rows.filter(pl.col(_ORDER) == order)
                checkpoint.damage.check_file(mine, id_column, checkpoint.files.merged)
            rows = rows.filter(ids.is_last_distinct())
        return rows.drop(_ORDER)

    return resolve


def shard_rows(
    store: Store, folder: str, id_column: str, job_fingerprint: str, shards: Sequence[Shard]
) -> tuple[pl.DataFrame, Found] | None:
    """One successful row per id of ``shards`` (range shards of one count) from the checkpoints
    of other counts under ``folder`` that overlap them; None when the table is needed instead."""
    count = shards[0].count
    indexes = sorted({s.index for s in shards})
    wanted: dict[int, set[int]] = {}  # count -> the overlapping indexes of that count
    candidates: list[tuple[str, Shard]] = []
    for name in names_in((f.path for f in store.list(store.path(folder))), store.root):
        partition = split_name(name)[2]
        old = Shard.parse(partition) if partition != UNPARTITIONED else None
        if old is None:
            if _same_job(Checkpoint(store, name).meta_file.read(), id_column, job_fingerprint):
                return None  # an unpartitioned or other-key checkpoint holds rows of any shard
            continue
        if old.count not in wanted:
            overlaps = (hashing.overlapping(i, count, old.count) for i in indexes)
            wanted[old.count] = {j for found in overlaps for j in found}
        if old.index in wanted[old.count]:
            candidates.append((name, old))
    found = Found()
    sources: list[tuple[Meta, pl.DataFrame]] = []
    for name, old in candidates:
        checkpoint = Checkpoint(store, name)
        meta = checkpoint.meta_file.read()
        if not _same_job(meta, id_column, job_fingerprint):
            continue
        assert meta is not None
        recorded = meta.scheme.shard if meta.scheme else None
        if recorded is None or recorded.rule != RANGE:
            return None  # written by the mod rule: its rows may belong to any shard
        if old.count == count:
            continue  # the run's own checkpoint: the run loads it anyway
        groups = _finished(checkpoint, meta, found)
        mine = [_of_shards(rows, id_column, count, indexes) for rows in groups]
        rows = pl.concat(mine) if mine else pl.DataFrame()
        if rows.height:  # ids checked as ``load`` checks them
            checkpoint.damage.check_file(rows, id_column, checkpoint.files.merged)
            sources.append((meta, rows))
    return _winners(sources, id_column), found


def _same_job(meta: Meta | None, id_column: str, job_fingerprint: str) -> bool:
    return (
        meta is not None
        and meta.id_column == id_column
        and (meta.job_fingerprint == job_fingerprint)
    )


def _finished(checkpoint: Checkpoint, meta: Meta, found: Found) -> Iterator[pl.DataFrame]:
    """The successful rows of one checkpoint (one per id), counted in ``found``.

    They come a row group of its merged file at a time, or all at once when the checkpoint
    holds parts left to merge.
    """
    found.checkpoints.append(checkpoint.url)
    found.schemes.append(meta.scheme.label if meta.scheme else "unknown")
    recorded = json.dumps(meta.function_fingerprint) if meta.function_fingerprint else None
    groups = checkpoint.merged_groups(meta.base_seq)
    if groups is None:
        groups = iter([checkpoint.load(meta.id_column, meta.base_seq).rows])
    for rows in groups:
        found.rows_read += rows.height
        done = rows.filter(pl.col(ERROR).is_null()).drop(CURRENT, strict=False)
        if done.height:
            yield done.with_columns(pl.lit(recorded, pl.Categorical).alias(FUNCTION))


def _of_shards(rows: pl.DataFrame, id_column: str, count: int, indexes: list[int]) -> pl.DataFrame:
    """The rows of ``rows`` in the shards ``indexes`` of ``count``."""
    return rows.filter(pl.Series(np.isin(hashing.shard_of(rows[id_column], count), indexes)))


def _winners(sources: list[tuple[Meta, pl.DataFrame]], id_column: str) -> pl.DataFrame:
    """One row per id: the newest finalized checkpoint wins (ids are unique within each one).

    Sources are concatenated oldest first and the last row of each id kept. That takes a hash
    pass over the ids, no sort of the whole table, and no copy of it when no id repeats. A
    frame-wide ``unique`` would need four times the table's memory at 10**7 rows.
    """
    if not sources:
        return pl.DataFrame()
    ordered = [rows for _, rows in sorted(sources, key=lambda s: s[0].finalized_at or 0.0)]
    table = pl.concat(ordered, how="diagonal_relaxed", rechunk=False)
    ids = table.get_column(id_column)
    if ids.n_unique() == table.height:  # the usual case, and five times cheaper than the mask
        return table
    return table.filter(ids.is_last_distinct())
