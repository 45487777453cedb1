"""``<name>.parquet.meta.json``: what a checkpoint is (its job, ids, outputs, scheme) and holds."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from checkpoint_assets.engine.errors import CorruptCheckpointError
from checkpoint_assets.engine.hashing import HASH_FORMAT
from checkpoint_assets.engine.scheme import Scheme

FORMAT_VERSION = 1


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
    # The oldest input hash format its rows may carry (see ``hashing.py``): a meta without it
    # was written by versions whose format 1 could not tell NaN, infinities and null apart inside
    # nested values. It stays 1 while the checkpoint lives, since rows of that format remain.
    input_hash_format: int = HASH_FORMAT
    # The fingerprint of the function of the last finished run (``function_fingerprint.py``):
    # None in metas of earlier versions, and when the run was given none.
    function_fingerprint: dict[str, str] | None = None

    def to_json(self) -> bytes:
        data = asdict(self)
        data["scheme"] = self.scheme.to_json() if self.scheme else None
        # Not sort_keys: the order of output_schema is the order of the output columns.
        return json.dumps(data, indent=2).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Meta:
        try:
            raw = json.loads(data)
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
