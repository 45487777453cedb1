"""Child process of the Bedrock kill tests, SIGKILLed at a chosen point.

``python bedrock_kill_child.py FAKE_URL S3_ENDPOINT BUCKET BASE_DIR ROWS SHARDS PARTITION POINT``:
one materialization of one shard through Bedrock's batch jobs. The point is installed by
wrapping ``BedrockBatches``' methods (no hook in the package): ``after_upload`` (the file in S3,
its URI not recorded), ``after_create`` (the job created, its ARN not recorded), ``downloading``
(half the shard's results read).

``python bedrock_kill_child.py online FAKE_URL S3_ENDPOINT BUCKET BATCH_ID CALLS``: the poll of a
submission below the minimum records (sent online), killed once ``CALLS`` requests have been
answered (the last of them not stored).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import bedrock_defs
import dagster as dg

from checkpoint_assets.engine.providers.submissions import Result
from checkpoint_assets.resources.bedrock_batches import BedrockBatches

POINTS = ("after_upload", "after_create", "downloading")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def after(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        fn(*args, **kwargs)
        die()

    return wrapped


def install(point: str, rows: int) -> None:
    if point == "after_upload":
        BedrockBatches.upload = after(BedrockBatches.upload)  # type: ignore[method-assign]
    elif point == "after_create":
        BedrockBatches.create = after(BedrockBatches.create)  # type: ignore[method-assign]
    elif point == "downloading":
        results = BedrockBatches.results

        def half(self: BedrockBatches, batch_id: str) -> Iterator[Result]:
            for i, result in enumerate(results(self, batch_id)):
                if i == rows // 2:
                    die()
                yield result

        BedrockBatches.results = half  # type: ignore[method-assign]
    else:
        raise ValueError(f"no such point {point!r}: one of {POINTS}")


def main(
    fake_url: str,
    s3: str,
    bucket: str,
    base_dir: str,
    rows: str,
    shards: str,
    partition: str,
    point: str,
) -> None:
    install(point, int(rows) // int(shards))
    bedrock = bedrock_defs.resource(fake_url, s3, bucket)
    dg.materialize(
        bedrock_defs.assets(int(rows), int(shards)),
        resources=bedrock_defs.resources(base_dir, bedrock),
        partition_key=partition,
    )


def online(fake_url: str, s3: str, bucket: str, batch_id: str, calls: str) -> None:
    api = bedrock_defs.resource(fake_url, s3, bucket).batch_provider()
    invoke, sent = api._invoke, []

    def counted(body: Any) -> dict[str, Any]:
        answer = invoke(body)
        sent.append(1)
        if len(sent) >= int(calls):
            die()  # answered, not stored
        return answer

    api._invoke = counted  # type: ignore[method-assign]
    api.poll(batch_id)


if __name__ == "__main__":
    if sys.argv[1] == "online":
        online(*sys.argv[2:7])
    else:
        main(*sys.argv[1:9])
