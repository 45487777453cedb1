"""Vertex AI's batch prediction as a ``BatchProvider``: the requests a JSONL file on Cloud
Storage, each carrying its ``custom_id`` in a label, the predictions read back from the job's
output folder. What it shares with the Gemini API's Batch Mode (jobs, states, errors, queue
refusals) is ``gemini_batches.Jobs``."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from checkpoint_assets.engine.providers.submissions import Limits, Request, Result
from checkpoint_assets.resources.gemini_batches import (
    Jobs,
    checked,
    created_since,
    error_result,
    with_defaults,
)

if TYPE_CHECKING:
    from google import genai

__all__ = ["KEY_LABEL", "VERTEX_LIMITS", "VertexBatches"]

# Vertex AI's batch prediction for Gemini: 200,000 requests and a 1 GB input file per job.
VERTEX_LIMITS: Final = Limits(max_requests=200_000, max_bytes=1000 * 1000 * 1000)
KEY_LABEL: Final = "checkpoint_assets_id"  # the label carrying a Vertex request's custom_id


class VertexBatches(Jobs):
    """Vertex AI batch prediction for ``model``, its files under ``gcs_prefix`` (``gs://``) on
    ``filesystem`` (a ``gcsfs`` file system)."""

    def __init__(
        self,
        client: genai.Client,
        model: str,
        gcs_prefix: str,
        filesystem: Any,
        defaults: Mapping[str, Any] | None = None,
        limits: Limits = VERTEX_LIMITS,
        *,
        concurrent_jobs: int | None = None,
    ) -> None:
        super().__init__(client, model, defaults or {}, concurrent_jobs)
        self.gcs_prefix = gcs_prefix.rstrip("/")
        self.fs = filesystem
        self.limits = limits

    def _line(self, request: Request) -> bytes:
        body = with_defaults(checked(request.body), self.defaults)
        body["labels"] = {**(body.get("labels") or {}), KEY_LABEL: request.custom_id}
        return json.dumps({"request": body}, separators=(",", ":")).encode() + b"\n"

    def size(self, request: Request) -> int:
        return len(self._line(request))

    def upload(self, requests: Sequence[Request], tag: str) -> str:
        uri = f"{self.gcs_prefix}/{tag}/input.jsonl"
        with self.fs.open(uri, "wb") as f:
            for r in requests:
                f.write(self._line(r))
        return uri

    def create(self, requests: Sequence[Request], upload: str | None, tag: str) -> str:
        if upload is None:
            upload = self.upload(requests, tag)
        dest = f"{self.gcs_prefix}/{tag}/output"
        return self._create(upload, tag, dest)

    def find(self, tag: str, since: float) -> str | None:
        listed = self.client.batches.list(config={"filter": f'display_name="{tag}"'})
        for job in listed:
            if job.display_name == tag and created_since(job.create_time, since):
                return job.name
        return None

    def results(self, batch_id: str) -> Iterator[Result]:
        job = self.client.batches.get(name=batch_id)
        directory = job.output_info.gcs_output_directory if job.output_info else None
        if not directory:
            return  # nothing was written: no request ran
        for path in sorted(self.fs.glob(f"{directory.rstrip('/')}/predictions*.jsonl")):
            with self.fs.open(path, "rb") as f:
                for raw in f:
                    if raw.strip():
                        yield _prediction(json.loads(raw))


def _prediction(line: Mapping[str, Any]) -> Result:
    """One line of Vertex's predictions: the request as sent, its ``response`` and ``status``
    (empty on success, the error's words otherwise)."""
    request = line.get("request") or {}
    custom = str((request.get("labels") or {}).get(KEY_LABEL))
    status = line.get("status")
    if status:
        return error_result(custom, status)
    response = line.get("response")
    if not isinstance(response, dict):
        return Result(custom, None, f"no response in the prediction line: {line!r}")
    return Result(custom, response)
