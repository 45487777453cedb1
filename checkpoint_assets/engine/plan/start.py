"""What a run starts from: the job it belongs to (``Job``) and the state of its checkpoint
(``Start``). ``opening.py`` makes them; ``found.py`` adds the rows it takes to ``Start``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from checkpoint_assets.engine.checkpoints.checkpoint import Stored
from checkpoint_assets.engine.checkpoints.compaction import Part
from checkpoint_assets.engine.checkpoints.meta import Meta
from checkpoint_assets.engine.plan import function_fingerprint
from checkpoint_assets.engine.plan.reparse import Parse
from checkpoint_assets.engine.reuse import layout as reuse
from checkpoint_assets.engine.sharding import hashing


@dataclass(frozen=True)
class Job:
    """The job a run belongs to: its result-changing settings and their fingerprint; and the
    fingerprint of its function (``function_fingerprint.py``), which is not part of the job: a
    change of it alone is reported, and stored results are kept.

    ``parse``: a request/parse job that keeps its answers (``_answer``) has it; rows it takes
    from the result store get their outputs from their answer parsed by it."""

    settings: dict[str, object]
    function: dict[str, str] | None = None
    parse: Parse | None = None

    @property
    def fingerprint(self) -> str:
        return hashing.job_fingerprint(self.settings)

    @property
    def scope(self) -> str:
        """The scope of its results in the result store (``reuse/layout.py``). With ``parse``,
        the request part of the function's fingerprint only: a changed parse reads the stored
        answers again."""
        function = self.function or {}
        if self.parse is not None:
            function = function_fingerprint.request_part(function)
        return reuse.scope(function, self.settings)


@dataclass(kw_only=True)
class Start:
    """The state of the checkpoint a run starts from (empty without checkpointing)."""

    meta: Meta | None = None
    known: Stored | None = None  # what was loaded, reused by finalize while nothing is written
    base_seq: int = 0  # the first flush of the current generation
    next_seq: int = 1
    parts: list[Part] = field(default_factory=list)
    imported: int = 0  # rows copied from other checkpoints (global resume)
    from_store: int = 0  # rows taken from the result store
    cost_saved: float | None = None  # what they cost when computed (with a budget)
    # This run's function fingerprint, which the meta records when the run finishes; and what
    # differs from the one recorded (reported only when stored results are reused).
    function_fingerprint: dict[str, str] | None = None
    function_changed: list[str] = field(default_factory=list)
    parse_changed: bool = False  # a request/parse job's parse part differs (no call needed)
    request_changed: bool = False  # anything else differs
