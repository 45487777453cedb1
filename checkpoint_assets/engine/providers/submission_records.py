"""The records of a checkpoint's provider batch submissions: what was sent, so nothing is sent
twice and nothing collected is lost.

One JSON file per submission, ``<name>.parquet.submissions/<tag>.json`` (``layout.py``), written
only by the run that holds the checkpoint's lock. Its ``stage`` moves forward, one write each,
and each is durable before the next request to the provider:

- ``intent``: the rows (ids, input hashes, in ``custom_id`` order) and the tag. Created with
  ``put_if_absent`` before anything is sent.
- ``uploaded``: the provider's file id (OpenAI), before the batch is created.
- ``created``: the provider's batch id.
- ``collected``: its results are stored as a part. Written after the part is durable.
- ``returned``: some of its rows are sent again in a new submission. Their requests failed in a
  transient way, or the batch expired or was cancelled before running them. Written after the
  part of its other results is durable, before the new submission's intent.
- ``dropped``: nothing of it reached the provider. After a crash, neither its batch nor its file
  was found. Its rows are submitted again in a new submission.
- ``refused``: the provider had no room for it in its queue (``submissions.QueueFull``). Nothing
  of it ran or is billed; its rows are submitted again, at the same attempt, once there is room.

A run that died at any point reads the records that are still open (intent, uploaded, created)
and re-attaches. A batch id is polled. An intent or an upload without one is looked up on the
provider by its tag (``BatchProvider.find``), and created only when it is not there. A run may
die after collecting a submission but before marking it ``collected``. Its results are then
downloaded again, and only the rows the checkpoint does not hold yet are stored.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Final

from checkpoint_assets.engine.checkpoints.layout import Files
from checkpoint_assets.engine.errors import CorruptCheckpointError
from checkpoint_assets.engine.storage import Store

OPEN: Final = ("intent", "uploaded", "created")
_FORMAT = 1


def new_tag() -> str:
    """A fresh submission tag: ``ca`` and 32 hex digits (valid in any provider's ids)."""
    return "ca" + secrets.token_hex(16)


@dataclass
class Submission:
    """One submission of rows to a provider's batch API (see the module docstring)."""

    tag: str
    provider: str
    ids: list[Any]  # the row ids, in custom_id order
    hashes: list[int]  # their input hashes when submitted
    stage: str = "intent"
    attempt: int = 1  # 1 for rows submitted fresh; n + 1 for rows of attempt n sent again
    created_at: float = field(default_factory=time.time)
    file_id: str | None = None
    batch_id: str | None = None
    note: str = ""  # why it was returned, dropped or refused
    tokens: int = 0  # its estimated input tokens, as the provider's queue counts them

    @property
    def open(self) -> bool:
        return self.stage in OPEN

    def to_json(self) -> bytes:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # no copies
        return json.dumps({"format": _FORMAT, **fields}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Submission:
        try:
            raw = json.loads(data)
            if raw.pop("format", None) != _FORMAT:
                raise ValueError("unknown format")
            return cls(**raw)
        except (ValueError, TypeError) as e:
            raise CorruptCheckpointError(
                where,
                f"is not a readable submission record ({e})",
                "Restore it from a backup, or move it aside: the rows it names are then "
                "submitted again (and paid for again if its batch had run).",
            ) from e


class Records:
    """The submission records of one checkpoint (its lock holder writes them)."""

    def __init__(self, store: Store, files: Files) -> None:
        self.store = store
        self.files = files

    def load(self) -> list[Submission]:
        """Every record, oldest first."""
        found = []
        for info in self.store.list(self.files.submissions):
            if info.name.endswith(".json"):
                where = self.store.display(info.path)
                found.append(Submission.from_json(self.store.get(info.path), where))
        return sorted(found, key=lambda s: (s.created_at, s.tag))

    def record_intent(self, submission: Submission) -> None:
        """Create the record before anything is sent; a tag is never reused."""
        path = self.files.submission(submission.tag)
        if not self.store.put_if_absent(path, submission.to_json()):
            raise CorruptCheckpointError(
                self.store.display(path), "already exists for a new submission tag"
            )

    def advance(self, submission: Submission, stage: str, **changes: Any) -> None:
        """Move ``submission`` to ``stage`` (with its new ids or note) and write it."""
        for name, value in changes.items():
            setattr(submission, name, value)
        submission.stage = stage
        self.store.put(self.files.submission(submission.tag), submission.to_json())
