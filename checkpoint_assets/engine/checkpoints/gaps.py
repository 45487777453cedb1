"""The parts of one checkpoint as listed, when listings may lag behind writes.

Some S3-compatible stores and caching gateways have listings that lag behind writes. Such a
listing would make a finalize merge without a part and then record a watermark above it: the
part's rows would be lost. At the start of a run, it would make the run compute the rows of the
missing parts again: paid twice.

So the parts are listed again after a pause in two cases:

- the listing misses a part this process wrote or saw, or a part covering it (compaction);
- the parts from the flush after the watermark leave a gap.

Flushes are numbered without holes. So a gap is a part the listing does not show, or parts
deleted outside this package. A gap also shows when parts remain while the merged file holding
the flushes below them is gone. The one gap this package leaves itself is a damaged part moved
aside to the quarantine folder (``damage.py``). To tell the two apart, that folder is listed once,
only when a gap is seen. A quarantined part's gap is no reason to list again.

If the listing still misses parts after the pauses, nothing is merged, deleted or computed. A
``StorageError`` says so, unless the caller accepts the gaps (``repair``, ``verify``). Such a
caller gets the gaps back.

A part whose write failed is written again under its own number before the run stops.
Compaction's parts cover the numbers of the parts they merge. Neither leaves a gap. A listing
that misses only the newest parts leaves no gap either, so that is not seen here. The run then
computes their rows again (paid twice) and writes its first part under the same number.
``Checkpoint.load`` reads both, so no row is lost.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from checkpoint_assets.engine.checkpoints.compaction import Part
from checkpoint_assets.engine.checkpoints.damage import Damage, Logger
from checkpoint_assets.engine.checkpoints.layout import part_range
from checkpoint_assets.engine.errors import StorageError
from checkpoint_assets.engine.storage import FileInfo

# A listing that misses parts this process wrote or saw, or that leaves a gap in the sequence, is
# listed again after these pauses (s).
_RELIST_SECONDS = (0.2, 0.5, 1.0, 2.0)
Flushes = tuple[int, int]  # first, last


class PartListing:
    """The part files of one checkpoint, checked against the parts this object wrote or saw."""

    def __init__(self, damage: Damage) -> None:
        self.store = damage.store
        self.files = damage.files
        self.damage = damage
        # Parts this object wrote or listed and has not deleted: a later listing must show them.
        self.known: dict[str, Part] = {}

    def parts(self, listing: Iterable[FileInfo] | None = None) -> list[Part]:
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

    def wrote(self, part: Part) -> None:
        self.known[part.path] = part

    def forget(self, paths: Iterable[str]) -> None:
        """``paths`` were deleted or moved aside: a later listing need not show them."""
        for path in paths:
            self.known.pop(path, None)

    def checked(
        self, watermark: int, start: int, *, accept_gaps: bool = False, log: Logger | None = None
    ) -> tuple[list[Part], list[Flushes]]:
        """``parts()``, listed again while the listing falls short (see the module docstring).

        It falls short while it misses a part this object wrote or saw above ``watermark``, or
        leaves a gap from the flush ``start``. Returns the parts and the gaps accepted
        (``accept_gaps``). Without ``accept_gaps``, a gap that stays raises ``StorageError``.
        A ``log`` (a run's start) gets a warning naming the flushes of parts moved to
        quarantine.
        """
        for pause in (*_RELIST_SECONDS, None):
            shown = self.parts()
            missing = [
                p
                for p in self.known.values()
                if p.last > watermark
                and not any(q.first <= p.first and q.last >= p.last for q in shown)
            ]
            gaps, moved = ([], []) if missing else self._gaps(shown, start)
            if not missing and not gaps:
                if moved and log is not None:
                    log.warning(
                        "Checkpoint %s: no part holds %s: damaged, moved aside to %s/ by an "
                        "earlier run; their rows are computed again.",
                        self.store.display(self.files.merged),
                        describe_flushes(moved),
                        self.store.display(self.files.quarantine),
                    )
                self.known.update((p.path, p) for p in shown if p.last > watermark)
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
            self.known.update((p.path, p) for p in shown if p.last > watermark)
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
            f"they were deleted (by hand, a lifecycle rule), run {self.damage.command('repair')}: "
            "it merges what is stored and the next run computes the rows of the missing flushes "
            "again. If listings keep lagging, use a store whose listings show every completed "
            "write (S3, GCS and Azure do), or turn off the listing cache of any gateway in "
            "front of it.",
        )

    def _gaps(self, shown: list[Part], start: int) -> tuple[list[Flushes], list[Flushes]]:
        """The gaps, split in two: those nothing explains, and those of quarantined parts.

        A gap is a range of flushes from ``start`` that no part of ``shown`` holds, below the
        highest shown. The second list holds the gaps of damaged parts moved to the quarantine
        folder. That folder is listed only when there is a gap.
        """
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
