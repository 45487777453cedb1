"""Hostile names: no checkpoint tag, partition key or asset key reaches outside ``base_dir``.

Each name below is either refused before any call with a clear ``CheckpointError`` (nothing
written), or stored under ``base_dir`` in a checkpoint of its own that the next run resumes.
``base_dir`` sits a few folders deep inside the test's temporary folder, and absolute names point
into that folder too, so a name that escapes lands where the test sees it (and nowhere else on
the machine).
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path
from typing import Any

import boto3
import dagster as dg
import polars as pl
import pytest
from helpers.jobs import ASSET, Job, build_job, stats, tickets

from checkpoint_assets import CheckpointError, CheckpointIOManager, checkpointed_asset

ROWS = 6

# What is wrong today, for the cases that escape (see the report of the fuzzing work).
ESCAPES = (
    "checkpoint names are joined with posixpath.join and never validated: '..' climbs out of "
    "the checkpoint's folder and an absolute name replaces base_dir"
)


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


class Sandbox:
    """A base_dir three folders deep in ``tmp_path``; ``escaped()`` lists files outside it."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.base = tmp_path / "deep" / "er" / "base"
        self.base.mkdir(parents=True)
        self.outside = tmp_path / "outside"  # where absolute names point

    def escaped(self) -> list[str]:
        return sorted(str(p.relative_to(self.tmp)) for p in _files(self.tmp) - _files(self.base))


def _run(
    job: Job, partition: str | None = None, **config: Any
) -> tuple[dict[str, Any] | None, BaseException | None]:
    try:
        return stats(job.materialize(partition, **config)), None
    except CheckpointError as e:
        return None, e


def _refused_or_resumed(box: Sandbox, job: Job, partition: str | None, **config: Any) -> None:
    """Refused before any call and nothing stored, or stored inside base_dir and resumed."""
    first, error = _run(job, partition, **config)
    assert box.escaped() == [], f"files written outside base_dir: {box.escaped()}"
    if error is not None:
        assert job.calls == [], "a refused name must be refused before any call"
        assert _files(box.base) == set()
        return
    assert first is not None and first["rows_computed"] == ROWS
    again, error = _run(job, partition, **config)
    assert error is None, repr(error)
    assert again is not None and (again["rows_resumed"], again["rows_computed"]) == (ROWS, 0)
    assert box.escaped() == []


def _tag(box: Sandbox, tag: str) -> str:
    return tag.replace("<abs>", str(box.outside))


HOSTILE = [
    "../escape",
    "../../../escape",
    "x/../../../../escape",
    "<abs>",
    "<abs>/nested",
    "a/b",
    "%2e%2e",
    "%2e%2e%2f%2e%2e%2fescape",
    "s3://other-bucket/x",
    "file:///tmp/x",
    "?#&=",
    "..",
    ".",
    "~",
    "back\\..\\slash",
    "ü/名前/😀",
    " ",
]
# Names whose checkpoint lands outside base_dir today.
ESCAPING = {"../../../escape", "x/../../../../escape", "<abs>", "<abs>/nested"}


def _cases(escaping: set[str], names: list[str] = HOSTILE) -> list[Any]:
    """The names to try (``escaping``: those that once landed outside base_dir)."""
    return list(names)


@pytest.mark.parametrize("tag", _cases(ESCAPING))
def test_a_hostile_checkpoint_tag_stays_inside_base_dir(tmp_path: Path, tag: str) -> None:
    box = Sandbox(tmp_path)
    job = build_job((str(box.base), {}), tickets(ROWS))

    _refused_or_resumed(box, job, None, checkpoint_tag=_tag(box, tag))


# Partition keys sit one folder deeper than tags (asset/tag/partition): fewer names, as the
# tags above cover the characters; Dagster itself refuses keys with control characters.
PARTITION_KEYS = ["../escape", "../../../escape", "<abs>", "a/b", "%2e%2e", "s3://x", "?#", ".."]
PARTITION_KEYS += ["", "ü/名前"]
PARTITION_ESCAPING = {"../../../escape", "<abs>"}


@pytest.mark.parametrize("key", _cases(PARTITION_ESCAPING, PARTITION_KEYS))
def test_a_hostile_partition_key_stays_inside_base_dir(tmp_path: Path, key: str) -> None:
    box = Sandbox(tmp_path)
    key = _tag(box, key)
    partitions = dg.StaticPartitionsDefinition([key, "plain"])
    job = build_job((str(box.base), {}), tickets(ROWS), partitions_def=partitions)

    _refused_or_resumed(box, job, key)


@pytest.mark.parametrize(
    "key",
    [
        "../../../escape",
        "<abs>",
        "a/b",
        "s3://x",
    ],
)
def test_an_ordinary_output_with_a_hostile_partition_key_stays_inside_base_dir(
    tmp_path: Path, key: str
) -> None:
    box = Sandbox(tmp_path)
    key = _tag(box, key)

    @dg.asset(partitions_def=dg.StaticPartitionsDefinition([key]))
    def plain() -> pl.DataFrame:
        return pl.DataFrame({"x": [1, 2]})

    manager = CheckpointIOManager(base_dir=str(box.base))
    with contextlib.suppress(CheckpointError):
        dg.materialize([plain], resources={"io_manager": manager}, partition_key=key)
    assert box.escaped() == []


@pytest.mark.parametrize(
    "key_prefix, name",
    [
        (["..", "..", ".."], "escape"),
        (["..", ".."], ".."),
        (["a.b"], "c.d"),
    ],
)
def test_a_hostile_asset_key_stays_inside_base_dir(
    tmp_path: Path, key_prefix: list[str], name: str
) -> None:
    box = Sandbox(tmp_path)
    data = {"df": tickets(ROWS)}
    calls: list[int] = []

    @dg.asset(name="tickets", io_manager_key="source_io")
    def source() -> pl.DataFrame:
        return data["df"]

    try:

        @checkpointed_asset(
            source="tickets", id_column="ticket_id", key_prefix=key_prefix, name=name
        )
        def hostile(batch: pl.DataFrame) -> pl.DataFrame:
            calls.append(batch.height)
            return batch.select("ticket_id", route=pl.col("body"))

    except dg.DagsterInvalidDefinitionError:
        return  # Dagster refuses the name itself: nothing can be written
    resources = {
        "io_manager": CheckpointIOManager(base_dir=str(box.base)),
        "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
    }
    instance = dg.DagsterInstance.ephemeral()
    for _ in range(2):
        try:
            dg.materialize([source, hostile], resources=resources, instance=instance)
        except CheckpointError:
            assert calls == []
            break
    assert box.escaped() == []
    assert sum(calls) in (0, ROWS), "the second run must resume"


@pytest.mark.parametrize(
    "tag",
    [
        "x/../default",
        "./default",
        "default/all",
    ],
)
def test_a_tag_never_shares_the_checkpoint_of_another_tag(tmp_path: Path, tag: str) -> None:
    box = Sandbox(tmp_path)
    job = build_job((str(box.base), {}), tickets(ROWS))
    job.materialize()  # the default tag

    hostile, error = _run(job, checkpoint_tag=tag)

    if error is None:  # separate tags never mix: nothing is resumed from another tag
        assert hostile is not None and hostile["rows_computed"] == ROWS
    else:
        assert len(job.calls) == (ROWS + 3) // 4  # the default run's calls only


# -- S3 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tag",
    [
        "/{victim}/stolen",
        "../../escape",  # S3 keys are literal: '..' is a name there, not a way up
        "a/b",
        "%2e%2e/x",
        "?#",
    ],
)
def test_on_s3_a_hostile_tag_writes_only_under_the_prefix(s3_server: str, tag: str) -> None:
    client = boto3.client(
        "s3",
        endpoint_url=s3_server,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    bucket, victim = (f"host-{uuid.uuid4().hex[:10]}" for _ in range(2))
    for name in (bucket, victim):
        client.create_bucket(Bucket=name)
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": s3_server, "region_name": "us-east-1"},
    }
    job = build_job((f"s3://{bucket}/team/checkpoints", options), tickets(ROWS))

    _run(job, checkpoint_tag=tag.format(victim=victim))

    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert all(k.startswith(f"team/checkpoints/{ASSET}/") for k in keys), keys
    assert client.list_objects_v2(Bucket=victim).get("KeyCount", 0) == 0
