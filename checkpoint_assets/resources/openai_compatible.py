"""OpenAI-compatible batch APIs (another provider's ``/v1/files`` and ``/v1/batches`` at the
resource's ``base_url``): ``OpenAIBatches`` with the differences their documentation states.

- The completion window: OpenAI takes ``24h`` only; others take more (``OpenAIResource``'s
  ``batch_completion_window``, such as ``7d``). A window the provider refuses is an error that
  says which setting to change.
- The batch's ``metadata``: some providers drop it, or refuse it. With ``batch_metadata=False``
  none is sent, and a batch is found again after a crash by its input file, named
  ``<tag>.jsonl``: each batch created since the submission was recorded has its file's name read.
- File limits: requests and bytes of one input file (``batch_max_requests``,
  ``batch_max_bytes``), where they are smaller than OpenAI's.

With OpenAI's settings (``24h``, metadata) every call is ``OpenAIBatches``'s. With others, a
refusal for queue room is said as OpenAI's is (:class:`QueueFull`): a 429 on create, or a batch
created ``failed`` with ``token_limit_exceeded``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from checkpoint_assets.engine.providers.submissions import Limits, Request
from checkpoint_assets.resources.openai_batches import OpenAIBatches

if TYPE_CHECKING:
    import openai

OPENAI_WINDOW: Final = "24h"
_WINDOW: Final = re.compile(r"[1-9]\d*[hd]")


def check_window(window: str) -> str:
    """``window`` if it is a duration in hours or days (``24h``, ``7d``), else a ValueError.

    >>> check_window("7d")
    '7d'
    """
    if not _WINDOW.fullmatch(window):
        raise ValueError(
            f"batch_completion_window must be hours or days such as 24h or 7d, got {window!r}."
        )
    return window


class CompatibleBatches(OpenAIBatches):
    """An OpenAI-compatible batch API with its own completion ``window`` and ``metadata`` (see
    the module docstring)."""

    def __init__(
        self,
        client: openai.OpenAI,
        endpoint: str,
        defaults: dict[str, Any],
        limits: Limits,
        *,
        window: str = OPENAI_WINDOW,
        metadata: bool = True,
        enqueued_tokens: int | None = None,
    ) -> None:
        super().__init__(client, endpoint, defaults, limits, enqueued_tokens)
        self.window, self.metadata = check_window(window), metadata

    def create(self, requests: Sequence[Request], upload: str | None, tag: str) -> str:
        import openai

        try:
            if self.window == OPENAI_WINDOW and self.metadata:
                return super().create(requests, upload, tag)
            if upload is None:
                upload = self.upload(requests, tag)
            extra = {"metadata": {"checkpoint_assets_submission": tag}} if self.metadata else {}
            return self._created(upload, completion_window=self.window, **extra)
        except openai.BadRequestError as e:
            raise self._refused(e) from e

    def _refused(self, e: Exception) -> Exception:
        """A create the provider refused, said as the setting to change, where it is one."""
        said = str(e)
        where = f"The batch API at {self.client.base_url}"
        if "metadata" in said.lower() and self.metadata:
            return ValueError(
                f"{where} refuses the batch's metadata ({said}): set batch_metadata=False on "
                "the resource; its batches are then found again by their input file's name."
            )
        if "completion_window" in said.lower():
            return ValueError(
                f"{where} refuses completion_window {self.window!r} ({said}): set "
                "batch_completion_window to one it takes (OpenAI's is 24h)."
            )
        return e

    def find(self, tag: str, since: float) -> str | None:
        if self.metadata:
            return super().find(tag, since)
        name = f"{tag}.jsonl"
        for batch in self.client.batches.list(limit=100):  # newest first, page by page
            if batch.created_at < since:
                return None
            if self.client.files.retrieve(batch.input_file_id).filename == name:
                return batch.id
        return None
