"""``<name>.parquet.meta.json``: what a checkpoint is (its job, ids, outputs, scheme) and holds,
and the file itself on its store (``MetaFile``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from checkpoint_assets.engine.errors import CorruptCheckpointError, NewerFormatError
from checkpoint_assets.engine.sharding.hashing import HASH_FORMAT
from checkpoint_assets.engine.sharding.scheme import Scheme

if TYPE_CHECKING:
    from checkpoint_assets.engine.checkpoints.damage import Damage
    from checkpoint_assets.engine.checkpoints.layout import Files
    from checkpoint_assets.engine.storage import Store

# Bumped with every new key (2: function_fingerprint). A reader refuses a newer format by name
# (``NewerFormatError``). It neither calls it corrupt nor drops keys it does not know when it
# writes meta again. Meta is always written in the writer's own format.
FORMAT_VERSION = 2


@dataclass
class Meta:
    """The content of a checkpoint's meta file."""

    job_fingerprint: str
    job: dict[str, Any]
    id_column: str
    id_dtype: str
    output_schema: dict[str, str] | None = None
    scheme: Scheme | None = None
    # The first flush of the current generation: ``resume: false`` starts a new one, and rows of
    # older flushes are ignored from then on.
    base_seq: int = 0
    input_fingerprint: str | None = None
    rows: dict[str, int] = field(default_factory=dict)  # at the last finalize: total, ok, failed
    usage: dict[str, float] = field(default_factory=dict)  # usage_columns summed, same time
    finalized_at: float | None = None
    format_version: int = FORMAT_VERSION
    # The oldest input hash format its rows may carry (see ``hashing.py``). A meta without it
    # holds rows of format 1, which cannot tell NaN, infinities and null apart inside nested
    # values. It stays 1 while the checkpoint lives, since rows of that format remain.
    input_hash_format: int = HASH_FORMAT
    # The fingerprint of the function of the last finished run (``function_fingerprint.py``):
    # None in older metas, and when the run was given none.
    function_fingerprint: dict[str, str] | None = None

    def to_json(self) -> bytes:
        data = asdict(self) | {"format_version": FORMAT_VERSION}
        data["scheme"] = self.scheme.to_json() if self.scheme else None
        # Not sort_keys: the order of output_schema is the order of the output columns.
        return json.dumps(data, indent=2).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Meta:
        try:
            raw = json.loads(data)
            if raw.get("format_version", 1) > FORMAT_VERSION:  # before any key it may not know
                raise NewerFormatError(where, raw["format_version"], FORMAT_VERSION)
            raw["scheme"] = Scheme.from_json(raw.get("scheme"))
            raw.setdefault("input_hash_format", 1)
            return cls(**raw)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise CorruptCheckpointError(
                where,
                f"is unreadable ({type(e).__name__}: {e})",
                "If it was edited by hand, restore it; otherwise start over with resume=False "
                "or a new checkpoint tag.",
            ) from e


class MetaFile:
    """A checkpoint's meta file on its store: read, written, and what is said when it is missing
    or unreadable (the remedies are ``damage.py``'s)."""

    def __init__(
        self,
        store: Store,
        files: Files,
        damage: Damage,
        data_files: Callable[[], list[str]],
    ) -> None:
        self.store = store
        self.path = files.meta
        self.damage = damage
        self.data_files = data_files  # the checkpoint's other files, listed when meta is missing

    def read(self) -> Meta | None:
        """The meta file (None when there is none); ``CorruptCheckpointError`` if unreadable."""
        data = self.store.get_or_none(self.path)
        if data is None:
            return None
        try:
            return Meta.from_json(data, self.store.display(self.path))
        except CorruptCheckpointError as e:
            raise e.advise(self.damage.remedy_without_meta()) from e.__cause__

    def missing(self, files: int) -> CorruptCheckpointError:
        """The error of a checkpoint whose meta file is gone while ``files`` data files remain."""
        return CorruptCheckpointError(
            self.store.display(self.path),
            f"is missing, but {files} other file(s) of the checkpoint remain: the job that wrote "
            "their rows cannot be checked, so they are not used",
            self.damage.remedy_without_meta(),
        )

    def required(self) -> Meta:
        """The meta file, for a command that needs it.

        Without it, a ``CheckpointError`` says what is missing and what to do: restore it, or
        run ``repair``. Or it says that there is no checkpoint.
        """
        meta = self.read()
        if meta is None:
            data = self.data_files()
            raise self.missing(len(data)) if data else self.damage.no_checkpoint()
        return meta

    def write(self, meta: Meta) -> None:
        self.store.put(self.path, meta.to_json())
