"""What is wrong with a checkpoint: every invariant a reader relies on, checked file by file.

A checkpoint is sound when:

- its meta file is readable, and present whenever other files are;
- its merged file and every unmerged part are readable Parquet;
- each of them has the id column (of the type the meta records) and unique ids;
- each of them that holds successes has the output columns;
- the files agree on their columns and types.

A resume stops at the first problem; ``problems`` reports all of them, and reads each file once.
Parts already merged (at or below the merged file's watermark) are not checked: the next writer
deletes them. Neither are files in quarantine, nor temporary files of killed writes (see
``damage.py``).
"""

from __future__ import annotations

import polars as pl

from checkpoint_assets.engine.checkpoints.checkpoint import Checkpoint
from checkpoint_assets.engine.checkpoints.meta import Meta
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.rows import resolve


def problems(checkpoint: Checkpoint) -> list[str]:
    """Every problem found in ``checkpoint``, one message each; empty when it is sound.

    Example::

        found = problems(Checkpoint(open_store("s3://bucket/checkpoints"), "a/default/all"))
    """
    try:
        meta = checkpoint.meta_file.required()
    except CheckpointError as e:
        return [str(e)]
    found: list[str] = []
    files: list[tuple[str, pl.DataFrame]] = []
    watermark = 0
    try:
        merged, watermark = checkpoint.read_merged()
        if merged is not None:
            files.append((checkpoint.files.merged, merged))
    except CheckpointError as e:
        found.append(str(e))
    parts, gaps = checkpoint.parts_and_gaps(watermark, meta.base_seq)
    if gaps:
        found.append(str(checkpoint.listing.gap_error(gaps, watermark)))
    for part in parts:
        if part.last <= watermark:
            continue  # merged already; the next writer deletes it
        try:
            files.append((part.path, checkpoint.read_file(part.path)))
        except CheckpointError as e:
            found.append(str(e))
    frames = []
    for path, frame in files:
        problem = file_problem(checkpoint, meta, path, frame)
        if problem is None:
            frames.append(frame)
        else:
            found.append(problem)
    if frames and not found:
        try:
            # the files agree on their columns and types
            resolve(frames, meta.id_column, checkpoint.url)
        except CheckpointError as e:
            found.append(str(e))
    return found


def file_problem(checkpoint: Checkpoint, meta: Meta, path: str, frame: pl.DataFrame) -> str | None:
    """What is wrong with one readable file (``frame``, read from ``path``), or None."""
    try:
        checkpoint.damage.check_file(frame, meta.id_column, path, list(meta.output_schema or {}))
    except CheckpointError as e:
        return str(e)
    id_dtype = str(frame.schema[meta.id_column])
    if id_dtype != meta.id_dtype and frame.height:  # an empty shard stores no typed ids
        return (
            f"Checkpoint file {checkpoint.store.display(path)} stores ids of type {id_dtype}, "
            f"but the checkpoint's meta says {meta.id_dtype}. Two different jobs probably "
            "share this checkpoint: give each its own checkpoint_tag, or start over with "
            "`resume: false`."
        )
    return None
