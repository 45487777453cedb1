"""One checkpoint on storage: its files (see ``layout.py``), read, merged, compacted, finalized.

Sequence numbers order everything. A flush takes the next number after the highest one on storage
(the merged file's watermark or any part's ``<last>``), so the order survives restarts and never
depends on clocks. The merged file records, inside its own Parquet metadata, the highest sequence
it contains (the watermark): parts at or below it are already merged. That makes finalize
crash-safe with a single atomic write: merge, write ``<name>.parquet`` (atomic), then delete the
merged parts; a crash between the two leaves parts that readers skip and the next writer deletes.

Rows are resolved per id by the rule of ``rows.py``; compaction is described in
``compaction.py``.

Damaged files. Nothing unreadable is ever taken as done, and nothing damaged is ever deleted:

- An unmerged part that is not Parquet (truncated, garbage): the lock holder that loads it (a run,
  ``checkpoint-assets repair``) moves it aside to ``<name>.parquet.quarantine/`` (``layout.py``),
  says so in a warning naming both places, and reads on without it; its rows are not stored, so
  the run computes them again. "Moving" is a copy, then a delete (one PUT and one DELETE on object
  stores); a crash between the two leaves the file in both places, and the next run moves it
  again. A reader without the lock (``status``, a downstream load) never moves anything: it
  raises ``CorruptCheckpointError`` saying what the next run or ``repair`` will do.
- An unreadable merged file stops any run with ``CorruptCheckpointError``: its rows may exist
  nowhere else. The remedy names ``checkpoint-assets verify`` and ``checkpoint-assets repair``,
  which rebuilds the checkpoint from what is readable (``repair.py``).
- A meta file that is not valid meta (garbage JSON), or missing while other files of the
  checkpoint remain: the run stops with ``CorruptCheckpointError``. The meta file is the only
  record of the job that wrote the rows (code version, settings), and rows of an unknown job are
  never resumed; ``repair`` cannot rebuild it, so it moves the meta and the data files aside
  (their rows kept there) and the next run starts the checkpoint again. Restoring a copy of the
  meta file is the other way out.
- Parts and files that already are below the merged file's watermark are not read: they are
  deleted by the next finalize whatever they hold.
- A gap in the sequence (parts above the watermark that leave out flushes, or parts while the
  merged file holding the flushes below them is gone) means a listing that lags behind writes, or
  parts deleted outside this package; see ``_parts_in_known``.
- A temporary file left by a killed local write (``<file>.tmp-<hex>``, see ``storage/local.py``;
  object stores have none) is never read or counted as a part; finalize (and so ``compact``) and
  ``repair`` delete those older than ``STALE_TEMPORARY_SECONDS``, which no write takes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import polars as pl

from checkpoint_assets.engine import parquet, rows
from checkpoint_assets.engine.compaction import COMPACT_FANOUT, Part, PartCache, mergeable_run
from checkpoint_assets.engine.errors import CorruptCheckpointError, StorageError
from checkpoint_assets.engine.layout import Files, part_range
from checkpoint_assets.engine.meta import Meta
from checkpoint_assets.engine.rows import CURRENT, ERROR, SEQ
from checkpoint_assets.engine.storage import FileInfo, Store
from checkpoint_assets.engine.storage.local import is_temporary

Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]

# A listing that misses parts this process wrote or saw, or that leaves a gap in the sequence, is
# listed again after these pauses (s).
_RELIST_SECONDS = (0.2, 0.5, 1.0, 2.0)
Flushes = tuple[int, int]  # first, last
# No write of one file takes this long: a temporary file this old is a killed writer's.
STALE_TEMPORARY_SECONDS = 15 * 60


@dataclass
class Stored:
    """Everything a checkpoint holds, resolved to one winning row per id."""

    rows: pl.DataFrame
    watermark: int
    next_seq: int
    parts: list[Part]  # live, unmerged parts
    leftover: list[Part] = field(default_factory=list)  # merged or covered, not yet deleted
    files: int = 0  # data files found (merged file and parts), before any was moved aside
    quarantined: list[str] = field(default_factory=list)  # damaged parts moved aside (to)
    gaps: list[Flushes] = field(default_factory=list)  # flushes no file holds (``accept_gaps``)


class Checkpoint:
    """The files of one checkpoint under a store. Readers need no lock; writers hold one."""

    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.name = name
        self.files = Files.under(store.root, name)
        self.cache = PartCache()
        # Parts this object wrote or listed and has not deleted: a later listing must show them.
        self.parts_known: dict[str, Part] = {}

    @property
    def url(self) -> str:
        return self.store.display(self.files.merged)

    # -- meta ----------------------------------------------------------------------------
    def read_meta(self) -> Meta | None:
        """The meta file (None when there is none); ``CorruptCheckpointError`` if unreadable."""
        data = self.store.get_or_none(self.files.meta)
        if data is None:
            return None
        try:
            return Meta.from_json(data, self.store.display(self.files.meta))
        except CorruptCheckpointError as e:
            raise e.advise(self.remedy_without_meta()) from e.__cause__

    def without_meta(self, files: int) -> CorruptCheckpointError:
        """The error of a checkpoint whose meta file is gone while ``files`` data files remain."""
        return CorruptCheckpointError(
            self.store.display(self.files.meta),
            f"is missing, but {files} other file(s) of the checkpoint remain: the job that wrote "
            "their rows cannot be checked, so they are not used",
            self.remedy_without_meta(),
        )

    # -- what to do about damage ---------------------------------------------------------
    def _command(self, verb: str) -> str:
        return f"`checkpoint-assets {verb} {self.store.url} {self.name}`"

    def remedy_without_meta(self) -> str:
        return (
            "Restore the meta file if you have a copy. Otherwise run "
            f"{self._command('repair')}: the meta file is the only record of the job that wrote "
            "the rows, so it cannot be rebuilt; repair moves the checkpoint's files aside to "
            f"{self.store.display(self.files.quarantine)}/ (keeping their rows there) and the "
            "next run computes every row again."
        )

    def remedy_merged(self) -> str:
        return (
            f"Run {self._command('verify')} to see every problem, then {self._command('repair')}"
            ": it rebuilds the checkpoint from what is readable and keeps the damaged file in "
            f"{self.store.display(self.files.quarantine)}/; the rows lost with it are computed "
            "again on the next run."
        )

    def remedy_part(self) -> str:
        return (
            "The next run of this checkpoint moves it aside to "
            f"{self.store.display(self.files.quarantine)}/ and computes its rows again; "
            f"{self._command('repair')} does that now."
        )

    def set_aside(self, path: str) -> str:
        """Move the damaged file ``path`` into the quarantine folder (copy, then delete; never
        lost); returns where it went. Only the lock holder calls it."""
        to = self.files.quarantined(path, time.time())
        data = self.store.get_or_none(path)
        if data is not None:
            self.store.put(to, data)
            self.store.delete([path])
        self.parts_known.pop(path, None)
        return to

    def remove_stale_temporary(self) -> list[str]:
        """Delete temporary files of killed local writes older than ``STALE_TEMPORARY_SECONDS``
        (object stores write no temporary files); returns their paths."""
        if not self.store.local:
            return []
        cutoff = time.time() - STALE_TEMPORARY_SECONDS
        old = [
            f.path
            for f in self.list_files()
            if is_temporary(f.path) and f.mtime is not None and f.mtime < cutoff
        ]
        self.store.delete(old)
        return old

    def write_meta(self, meta: Meta) -> None:
        self.store.put(self.files.meta, meta.to_json())

    # -- reading -------------------------------------------------------------------------
    def list_parts(
        self, listing: Iterable[FileInfo] | None = None
    ) -> tuple[list[Part], list[Part]]:
        """(live parts in sequence order, redundant parts that may be deleted).

        ``listing``: files already listed (a recursive listing of a folder above this
        checkpoint); without it the parts folder is listed.
        """
        return _split(self._parts_in(listing))

    def _parts_in(self, listing: Iterable[FileInfo] | None = None) -> list[Part]:
        """Every part file in ``listing`` (default: the parts folder), in sequence order."""
        if listing is None:
            listing = self.store.list(self.files.parts)
        parts: list[Part] = []
        for info in listing:
            found = part_range(info.name)
            # Temporary files of an interrupted local write, or other folders' files, are not parts.
            if found and info.path.rsplit("/", 1)[0] == self.files.parts:
                parts.append(Part(info.path, found[0], found[1], info.size))
        parts.sort(key=lambda p: (p.first, -p.last))
        return parts

    def _parts_in_known(
        self, watermark: int, start: int, *, accept_gaps: bool = False, log: Logger | None = None
    ) -> tuple[list[Part], list[Flushes]]:
        """``_parts_in()``, checked against the parts this object wrote or listed before, and for
        gaps in the sequence from ``start``; returns the parts and the gaps accepted.

        A listing that lags behind writes (some S3-compatible stores, caching gateways) would
        make a finalize merge without a part and then record a watermark above it: its rows
        would be lost. At the start of a run it would make the run compute the rows of the
        parts it misses again: paid twice. So a listing is listed again after a pause when it
        misses a part this object wrote or saw (or a part covering it: compaction), or when the
        parts from ``start`` (the flush after the watermark) leave a gap: flushes are numbered
        without holes, so a gap is a part the listing does not show. The one gap this package
        leaves itself is a damaged part moved aside to the quarantine folder, which is listed
        (once, only when a gap is seen) to tell them apart: that gap is no reason to list
        again, and a ``log`` (a run's start) gets a warning naming it. If the listing still
        misses parts after the pauses, nothing is merged, deleted or computed: a
        ``StorageError`` says so, unless ``accept_gaps`` (``repair``), which gets them back.

        A part whose write failed is written again under its own number before the run stops,
        and compaction's parts cover the numbers of the parts they merge: neither leaves a gap.
        A listing that misses only the newest parts leaves none either, so that is not seen
        here: the run computes their rows again (paid twice) and writes its first part under
        the same number; ``load`` reads both, so no row is lost.
        """
        for pause in (*_RELIST_SECONDS, None):
            shown = self._parts_in()
            missing = [
                p
                for p in self.parts_known.values()
                if p.last > watermark
                and not any(q.first <= p.first and q.last >= p.last for q in shown)
            ]
            gaps, moved = ([], []) if missing else self._gaps(shown, start)
            if not missing and not gaps:
                if moved and log is not None:
                    log.warning(
                        "Checkpoint %s: no part holds %s: damaged, moved aside to %s/ by an "
                        "earlier run; their rows are computed again.",
                        self.url,
                        describe_flushes(moved),
                        self.store.display(self.files.quarantine),
                    )
                self.parts_known.update((p.path, p) for p in shown if p.last > watermark)
                return shown, []
            if pause is not None:
                time.sleep(pause)
        folder = self.store.display(self.files.parts)
        waited = f"even after listing again for {sum(_RELIST_SECONDS):.0f} s"
        if missing:
            raise StorageError(
                f"The listing of {folder} does not show {len(missing)} part(s) this run wrote or "
                f"saw, such as {self.store.display(missing[0].path)}, {waited}: the store's "
                "listings lag behind its writes. Nothing was merged or deleted.",
                "Run again: it resumes. If it happens again, use a store whose listings show "
                "every completed write (S3 does), or turn off the listing cache of any gateway "
                "in front of it.",
            )
        if accept_gaps:
            self.parts_known.update((p.path, p) for p in shown if p.last > watermark)
            return shown, gaps
        raise self.gap_error(gaps, watermark, waited)

    def gap_error(self, gaps: Sequence[Flushes], watermark: int, waited: str = "") -> StorageError:
        """The error of parts that leave out ``gaps`` above the merged file's ``watermark``;
        ``waited``: how long a run listed again before giving up."""
        folder = self.store.display(self.files.parts)
        below = f"merged up to flush {watermark}" if watermark else "there is no merged file"
        what = (
            f"No part in the listing of {folder} holds {describe_flushes(gaps)}, though parts "
            f"of later flushes are there ({below}){', ' + waited if waited else ''}. Either the "
            "store's listing lags behind its writes, or those parts were deleted."
        )
        if waited:
            what += (
                " Their rows are neither taken as done nor computed again, and nothing was "
                "merged or deleted."
            )
        return StorageError(
            what,
            "Run again in a few minutes: once the listing shows the parts, the run resumes. If "
            f"they were deleted (by hand, a lifecycle rule), run {self._command('repair')}: it "
            "merges what is stored and the next run computes the rows of the missing flushes "
            "again. If listings keep lagging, use a store whose listings show every completed "
            "write (S3, GCS and Azure do), or turn off the listing cache of any gateway in "
            "front of it.",
        )

    def parts_and_gaps(self, watermark: int, base_seq: int = 0) -> tuple[list[Part], list[Flushes]]:
        """(live parts, flushes above ``watermark`` that no part holds) after listing again
        while there is a gap (see ``_parts_in_known``); raises nothing about gaps."""
        listed, gaps = self._parts_in_known(
            watermark, max(watermark + 1, base_seq), accept_gaps=True
        )
        return _split(listed)[0], gaps

    def _gaps(self, shown: list[Part], start: int) -> tuple[list[Flushes], list[Flushes]]:
        """(flushes from ``start`` that no part of ``shown`` holds, below the highest shown;
        those of them held by damaged parts moved to the quarantine folder), listing that
        folder only when there is a gap."""
        gaps = _holes(((p.first, p.last) for p in shown), start)
        if not gaps:
            return [], []
        moved: list[Flushes] = []
        for info in self.store.list(self.files.quarantine):
            found = part_range(info.name.split(".parquet.", 1)[0] + ".parquet")
            if found is not None:
                moved.append(found)
        unexplained = _holes([*((p.first, p.last) for p in shown), *moved], start)
        return unexplained, [g for g in gaps if g not in unexplained]

    def read_file(self, path: str, data: bytes | None = None) -> pl.DataFrame:
        """One stored Parquet file (``data``, if already fetched); unreadable means corrupt."""
        raw = self.store.get(path) if data is None else data
        try:
            return parquet.decode(raw)
        except Exception as e:
            where = self.store.display(path)
            remedy = self.remedy_merged() if path == self.files.merged else self.remedy_part()
            raise CorruptCheckpointError(where, f"is unreadable ({_first_line(e)})", remedy) from e

    def read_merged(self) -> tuple[pl.DataFrame | None, int]:
        """The merged file's rows and watermark (``None, 0`` when there is none)."""
        raw = self.store.get_or_none(self.files.merged)
        if raw is None:
            return None, 0
        frame = self.read_file(self.files.merged, raw)  # reads the footer: watermark() can too
        return frame, parquet.watermark(raw)

    def load(
        self,
        id_column: str,
        base_seq: int = 0,
        outputs: Sequence[str] | None = None,
        *,
        quarantine: Logger | None = None,
        accept_gaps: bool = False,
    ) -> Stored:
        """Read the merged file and every part above its watermark, resolved to one row per id.

        ``outputs``, the job's output columns when known, must be in every file with successes.
        ``quarantine``: the caller holds the lock, so an unreadable part is moved aside with a
        warning on this logger and its rows count as not done; without it, it raises. An
        unreadable merged file always raises (see the module docstring). A listing that leaves
        a gap in the sequence raises ``StorageError`` unless ``accept_gaps`` (``Stored.gaps``).
        """
        merged, watermark = self.read_merged()
        listed, gaps = self._parts_in_known(
            watermark, max(watermark + 1, base_seq), accept_gaps=accept_gaps, log=quarantine
        )
        files = len(listed) + (merged is not None)
        frames_of: dict[str, pl.DataFrame] = {}
        moved: list[str] = []
        while True:  # again after a part is moved aside: parts it covered are live again
            live, redundant = _split(listed)
            parts = [p for p in live if p.last > watermark]
            # A part covered by another (compaction's input left by a crash, usually) is read
            # too: the part covering it may be one that a run wrote under the same flush number
            # after a listing that missed this one, holding other rows.
            covered = [p for p in redundant if p.last > watermark]
            damaged = self._read_parts(
                parts + covered, base_seq, id_column, outputs, frames_of, quarantine
            )
            if damaged is None:
                break
            to = self.set_aside(damaged.path)
            listed.remove(damaged)
            moved.append(to)
            assert quarantine is not None
            quarantine.warning(
                "Checkpoint file %s is unreadable: moved it aside to %s; the rows it held are "
                "computed again.",
                self.store.display(damaged.path),
                self.store.display(to),
            )
        leftover = [p for p in live if p.last <= watermark] + redundant
        frames: list[pl.DataFrame] = []
        use_merged = merged is not None and watermark >= base_seq
        if merged is not None and use_merged:
            self.check_file(merged, id_column, self.files.merged, outputs)
            frames.append(_since(merged, base_seq))
        frames += [
            _since(frames_of[p.path], base_seq) for p in parts + covered if p.path in frames_of
        ]
        highest = max([watermark, *(p.last for p in parts)])
        stored = rows.concat(frames, self.url) if frames else rows.empty(id_column)
        if len(frames) > 1 or not use_merged:
            stored = rows.pick_winners(stored, id_column)  # the merged file alone was checked
        return Stored(stored, watermark, highest + 1, parts, leftover, files, moved, gaps)

    def _read_parts(
        self,
        parts: list[Part],
        base_seq: int,
        id_column: str,
        outputs: Sequence[str] | None,
        frames_of: dict[str, pl.DataFrame],
        quarantine: Logger | None,
    ) -> Part | None:
        """Read ``parts`` not read yet into ``frames_of``; the first unreadable one, when the
        caller may move it aside (else its error is raised)."""
        for part in parts:
            if part.last < base_seq or part.path in frames_of:
                continue
            frame = self.cache.get(part.path)
            if frame is None:
                try:
                    frame = self.read_file(part.path)
                except CorruptCheckpointError:
                    if quarantine is None:
                        raise
                    return part
                self.check_file(frame, id_column, part.path, outputs)
            frames_of[part.path] = frame
        return None

    def check_file(
        self, frame: pl.DataFrame, id_column: str, path: str, outputs: Sequence[str] | None = None
    ) -> None:
        """Raise ``CorruptCheckpointError`` unless the file at ``path`` (holding ``frame``) has
        the id column, unique ids and, where it holds successes, the ``outputs``."""
        where = self.store.display(path)
        missing = [c for c in outputs or () if c not in frame.columns]
        if missing and ERROR in frame.columns and frame.get_column(ERROR).is_null().any():
            problem = f"holds results without the output columns {missing} (it has {frame.columns})"
            raise CorruptCheckpointError(where, problem)
        if id_column not in frame.columns:
            problem = f"has no id column {id_column!r} (it has {frame.columns})"
            raise CorruptCheckpointError(where, problem)
        ids = frame.get_column(id_column)
        if rows.distinct_count(ids) != frame.height:
            dupes = ids.filter(ids.is_duplicated()).unique().head(5).to_list()
            problem = f"holds duplicate ids {dupes}, which this package never writes"
            raise CorruptCheckpointError(where, problem)

    # -- writing -------------------------------------------------------------------------
    def write_part(
        self, frame: pl.DataFrame, first: int, last: int | None = None, *, data: bytes | None = None
    ) -> Part:
        """Write ``frame`` (``_seq`` already set) as the part covering ``first``..``last``.

        ``data``: the rows as ``encode_part`` gave them, when the caller encoded them already.
        """
        last = first if last is None else last
        path = self.files.new_part(first, last)
        if data is None:
            data = self.encode_part(frame)
        self.store.put(path, data)
        self.cache.remember(path, frame)
        part = Part(path, first, last, len(data))
        self.parts_known[path] = part
        return part

    @staticmethod
    def encode_part(frame: pl.DataFrame) -> bytes:
        """The Parquet bytes of a part holding ``frame``."""
        return parquet.encode(frame, part=True)

    def compact(self, parts: list[Part], id_column: str) -> list[Part]:
        """Merge runs of same-level parts while too many exist (see ``compaction.py``).

        Returns the live parts afterwards. Safe to interrupt at any point.
        """
        parts = list(parts)
        while (start := mergeable_run(parts)) is not None:
            run = parts[start : start + COMPACT_FANOUT]
            frames = [self.cache.take(p.path) for p in run]
            pairs = zip(frames, run, strict=True)
            merged = rows.concat(
                [f if f is not None else self.read_file(p.path) for f, p in pairs], self.url
            ).rechunk()  # one chunk: a part made of thousands of tiny ones is slow to use
            part = self.write_part(rows.pick_winners(merged, id_column), run[0].first, run[-1].last)
            self._delete(run)
            parts[start : start + COMPACT_FANOUT] = [part]
        return parts

    def finalize(
        self,
        id_column: str,
        current_ids: pl.Series | None,
        base_seq: int = 0,
        known: Stored | None = None,
        tail: pl.DataFrame | None = None,
    ) -> pl.DataFrame:
        """Merge every part into ``<name>.parquet`` and delete them; returns the stored rows.

        ``current_ids`` (the ids of this run's input) marks which rows form the result; rows
        outside it stay stored with ``_current`` false. ``None`` keeps the previous marks.
        ``known`` is what ``load`` returned to a writer that has written nothing since: it spares
        reading everything again. ``tail``: the writer's last rows (``_seq`` set, above every
        stored one), merged in without being written as a part first. A checkpoint whose rows
        and marks are unchanged (a resume with nothing left to do) is not rewritten.
        """
        stored = known if known is not None else self.load(id_column, base_seq)
        frame = stored.rows
        changed = bool(stored.parts) or stored.watermark < base_seq
        watermark = stored.next_seq - 1
        if tail is not None and tail.height:
            merged = rows.concat([frame, tail], self.url) if frame.height else tail
            frame = rows.pick_winners(merged, id_column)
            watermark = max(watermark, int(tail.get_column(SEQ).max()))  # type: ignore[arg-type]
            changed = True
        if current_ids is not None:
            before = frame.get_column(CURRENT) if CURRENT in frame.columns else None
            frame = frame.with_columns(_marks(frame.get_column(id_column), current_ids))
            changed = changed or before is None or not before.equals(frame.get_column(CURRENT))
            if current_ids.is_sorted() and not frame.get_column(id_column).is_sorted():
                # Store rows in the input's order, so that resumes match ids by a sorted merge.
                frame = frame.sort(id_column)
                changed = True
        elif CURRENT in frame.columns:
            frame = frame.with_columns(pl.col(CURRENT).fill_null(True))
        else:
            frame = frame.with_columns(pl.lit(True).alias(CURRENT))
        if changed:
            data = parquet.encode(frame, {parquet.WATERMARK_KEY: str(watermark)})
            self.store.put(self.files.merged, data)
        # Everything this load saw is now merged: delete it without listing again.
        self._delete([*stored.parts, *stored.leftover])
        self.cache.clear()
        self.remove_stale_temporary()
        return frame

    def _delete(self, parts: Sequence[Part]) -> None:
        self.store.delete(p.path for p in parts)
        for part in parts:
            self.parts_known.pop(part.path, None)

    def data_files(self) -> list[str]:
        """Paths of the merged file (if any) and of every part file, merged ones included."""
        listed = self.list_files()
        merged = [f.path for f in listed if f.path == self.files.merged]
        return merged + [p.path for p in self._parts_in(listed)]

    def list_files(self) -> list[FileInfo]:
        """Every file of this checkpoint: merged, meta, lock, parts and quarantined files."""
        folder = self.files.merged.rsplit("/", 1)[0]
        found = [f for f in self.store.list(folder) if self.files.owns(f.path)]
        return found + self.store.list(self.files.parts) + self.store.list(self.files.quarantine)

    # -- result --------------------------------------------------------------------------
    def read_result(
        self, id_column: str, output_columns: Sequence[str] | None, *, meta: Meta | None = None
    ) -> pl.DataFrame:
        """The result a downstream asset sees: id, output columns and ``_error``.

        ``meta``: the checkpoint's meta when the caller has read it already.
        """
        meta = meta if meta is not None else self.read_meta()
        base_seq = meta.base_seq if meta else 0
        frame = self.load(id_column, base_seq).rows
        if CURRENT in frame.columns:
            frame = frame.filter(pl.col(CURRENT).fill_null(True))
        keep = [id_column, *(output_columns or rows.outputs_of(frame, id_column)), ERROR]
        return frame.select([c for c in keep if c in frame.columns])


def _split(parts: list[Part]) -> tuple[list[Part], list[Part]]:
    """(live, redundant) of parts in sequence order: a part covered by a larger one written
    before a crash (compaction's output) is redundant."""
    live: list[Part] = []
    redundant: list[Part] = []
    for part in parts:
        if live and part.last <= live[-1].last:
            redundant.append(part)
        else:
            live.append(part)
    return live, redundant


def _holes(ranges: Iterable[Flushes], start: int) -> list[Flushes]:
    """The flushes from ``start`` that none of ``ranges`` holds, below the highest of them."""
    holes: list[Flushes] = []
    expected = start
    for first, last in sorted(ranges):
        if first > expected:
            holes.append((expected, first - 1))
        expected = max(expected, last + 1)
    return holes


def describe_flushes(gaps: Sequence[Flushes]) -> str:
    """``gaps`` for people: "flush 5", "flushes 5 to 7", the first three of several."""
    said = [f"flush {a}" if a == b else f"flushes {a} to {b}" for a, b in gaps[:3]]
    more = f" and {len(gaps) - 3} more gap(s)" if len(gaps) > 3 else ""
    return ", ".join(said) + more


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _since(frame: pl.DataFrame, base_seq: int) -> pl.DataFrame:
    """Rows of flushes ``base_seq`` and later (every row when the generation began at 0)."""
    return frame if base_seq <= 0 else frame.filter(pl.col(SEQ) >= base_seq)


def _marks(ids: pl.Series, current_ids: pl.Series) -> pl.Expr:
    """``_current`` for each stored id: is it in this run's input?

    An expression, not a Series: a new Series of one chunk beside columns read in many would make
    the next ``select`` copy every column into one chunk.
    """
    if ids.equals(current_ids):  # stored in the input's order: every row is current
        return pl.lit(True).alias(CURRENT)
    return pl.col(ids.name).is_in(current_ids.implode()).alias(CURRENT)
