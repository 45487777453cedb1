"""``provider_batches_sensor``: request the run that collects a shard's provider batches.

It requests that run once the batches have ended, so no run holds a slot while the provider
works. Each tick takes these steps, in order:

1. ``_follow()`` reads new observations of the asset that name pending batches
   (``batches_pending``). A run that submitted and ended records them (see ``pending.py``). The
   cursor remembers the latest per partition, with the run that submitted them.
2. ``_settled()`` forgets partitions materialized since their observation.
3. ``_ready()`` takes each remembered partition not requested yet and not in progress. It polls
   its batches: one request each, stopping at the first still running. When none is running
   any more, it requests the partition's run, once per submitting run.
4. A partition whose rows wait for room in the provider's queue (``rows_waiting_for_queue``)
   and that has no batch of its own is requested once room is likely. Each partition whose
   batches were seen ended in this tick frees about one submission's room: that many waiting
   partitions are requested, those that have waited longest first. When none of the asset's
   partitions has a batch running, each waiting partition is requested once
   ``_ROOM_RETRY_SECONDS`` have passed since its run ended (the queue is held by others).

The collecting run re-attaches to the batches through the checkpoint's submission records. It
downloads their results and finishes in seconds. It submits nothing that was submitted, and
submits the rows that waited for room, as far as the queue has room.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Never

import dagster as dg

from checkpoint_assets.engine.checkpoints.layout import UNPARTITIONED
from checkpoint_assets.engine.errors import CheckpointError
from checkpoint_assets.engine.providers.submissions import BatchProvider, State
from checkpoint_assets.integration import metadata as md
from checkpoint_assets.integration.watch.events import records_after

COLLECTS_TAG = "checkpoint_assets/collects"  # the run that submitted what this run collects
_CURSOR_VERSION = 2
# A partition whose rows wait for room in a queue none of the asset's batches holds (other jobs
# fill it) is tried again after this long.
_ROOM_RETRY_SECONDS = 600.0


@dataclass
class Pending:
    """The batches a partition waits for: the run that submitted them and its observation, and
    the rows that wait for room in the provider's queue."""

    run_id: str
    batches: list[str]
    storage_id: int
    requested: bool = False
    waiting: int = 0
    at: float = 0.0  # when it was observed (seconds since the epoch)


@dataclass
class PendingState:
    """What the sensor remembers between ticks (its JSON cursor)."""

    after: int = 0  # last observation read (storage id)
    pending: dict[str, Pending] = field(default_factory=dict)

    def to_json(self) -> str:
        pending = {
            k: [p.run_id, p.batches, p.storage_id, p.requested, p.waiting, p.at]
            for k, p in sorted(self.pending.items())
        }
        return json.dumps({"v": _CURSOR_VERSION, "after": self.after, "pending": pending})

    @classmethod
    def from_json(cls, text: str | None) -> PendingState:
        data = json.loads(text) if text else {}
        if data.get("v") != _CURSOR_VERSION:
            return cls()
        pending = {
            k: Pending(str(run), list(batches), int(at), bool(req), int(waiting), float(when))
            for k, (run, batches, at, req, waiting, when) in data["pending"].items()
        }
        return cls(int(data["after"]), pending)


def sensor_name(key: dg.AssetKey) -> str:
    """The default name of the ``provider_batches_sensor`` of the asset ``key``."""
    return f"{key.to_python_identifier()}_provider_batches"


def provider_batches_sensor(
    asset: dg.AssetsDefinition,
    *,
    minimum_interval_seconds: int = 60,
    name: str | None = None,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
    **provider_and_endpoint: Never,
) -> dg.SensorDefinition:
    """A sensor that requests a partition's run of ``asset`` (a :func:`provider_batch_asset`
    that submits and ends) once the provider batches it waits for have ended.

    Each tick polls only the batches of partitions that wait. It sends one request per batch,
    stopping at a partition's first batch still running. That is a few requests a minute,
    however many rows. It polls through the resource and endpoint the asset declares (its
    ``provider`` and ``endpoint``), so they are not given here.

    Example::

        defs = dg.Definitions(
            assets=[tickets, ticket_routing],
            sensors=[provider_batches_sensor(ticket_routing)],
            resources={"openai": OpenAIResource(...), "io_manager": CheckpointIOManager(...)},
        )
    """
    key = asset.key
    label = key.to_user_string()
    if provider_and_endpoint:
        given = ", ".join(f"{k}=" for k in provider_and_endpoint)
        raise TypeError(
            f"provider_batches_sensor takes the provider and endpoint from the asset's "
            f"provider_batch_asset(provider=..., endpoint=...): call "
            f"provider_batches_sensor({key.path[-1]}) without {given}."
        )
    provider, endpoint = _declared(asset)

    @dg.sensor(
        name=name or sensor_name(key),
        target=asset,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        required_resource_keys={provider},
        description=f"Requests the runs of {label} that collect its provider batches once they "
        "have ended.",
    )
    def sensor(context: dg.SensorEvaluationContext, **resources: Any) -> dg.SensorResult:
        # Dagster passes the resource by its key when the sensor is called directly.
        resource = resources.get(provider) or getattr(context.resources, provider)
        state = PendingState.from_json(context.cursor)
        instance = context.instance
        _follow(instance, key, state)
        _settled(instance, key, state)
        api = resource.batch_provider(endpoint)
        requests = []
        for partition in _ready(instance, key, asset.partitions_def, api, state):
            waited = state.pending[partition]
            context.log.info(
                f"The provider batches of {label} {partition} have ended: requesting the run "
                f"that collects them (submitted by run {waited.run_id})."
            )
            requests.append(
                dg.RunRequest(
                    partition_key=None if partition == UNPARTITIONED else partition,
                    run_key=f"{partition}:{waited.run_id}",
                    tags={COLLECTS_TAG: waited.run_id},
                )
            )
        if requests:
            return dg.SensorResult(run_requests=requests, cursor=state.to_json())
        waiting = [p for p, w in state.pending.items() if not w.requested]
        reason = (
            f"{len(waiting)} partition(s) of {label} wait for provider batches still running."
            if waiting
            else f"No partition of {label} waits for provider batches."
        )
        return dg.SensorResult(skip_reason=reason, cursor=state.to_json())

    return sensor


def _declared(asset: dg.AssetsDefinition) -> tuple[str, Any]:
    """The resource key and endpoint that ``provider_batch_asset`` recorded on ``asset``."""
    key = asset.key
    declared = asset.metadata_by_key.get(key, {})
    provider = md.plain(declared.get(md.PROVIDER))
    if not isinstance(provider, str):
        raise CheckpointError(
            f"provider_batches_sensor({key.path[-1]}): {key.to_user_string()} declares no "
            "provider in its definition metadata, so it is not a provider_batch_asset.",
            "Give the sensor the asset that provider_batch_asset made; for a "
            "checkpointed_asset, use failed_partitions_sensor.",
        )
    return provider, md.plain(declared.get(md.ENDPOINT))


def _follow(instance: dg.DagsterInstance, key: dg.AssetKey, state: PendingState) -> None:
    """Remember the latest pending batches of each partition from new observations."""
    for record in records_after(instance.fetch_observations, key, state.after):
        state.after = max(state.after, record.storage_id)
        observation = record.asset_observation
        found = observation.metadata.get(md.BATCHES_PENDING) if observation else None
        if observation is None or found is None:
            continue
        batches = json.loads(str(md.plain(found)))
        partition = observation.partition or UNPARTITIONED
        waiting = int(md.plain(observation.metadata.get(md.ROWS_WAITING_FOR_QUEUE)) or 0)
        at = record.timestamp
        state.pending[partition] = Pending(
            record.run_id, batches, record.storage_id, waiting=waiting, at=at
        )


def _settled(instance: dg.DagsterInstance, key: dg.AssetKey, state: PendingState) -> None:
    """Forget partitions materialized since their batches were recorded."""
    if not state.pending:
        return
    latest: Mapping[str, int]
    if set(state.pending) == {UNPARTITIONED}:
        records = instance.fetch_materializations(key, limit=1).records
        latest = {UNPARTITIONED: records[0].storage_id} if records else {}
    else:
        latest = instance.get_latest_storage_id_by_partition(
            key, dg.DagsterEventType.ASSET_MATERIALIZATION, set(state.pending)
        )
    for partition, waited in list(state.pending.items()):
        if latest.get(partition, 0) > waited.storage_id:
            del state.pending[partition]


def _ready(
    instance: dg.DagsterInstance,
    key: dg.AssetKey,
    partitions_def: dg.PartitionsDefinition | None,
    api: BatchProvider,
    state: PendingState,
) -> list[str]:
    """Partitions whose batches have all ended, or whose rows waiting for queue room likely
    have it now (the module docstring), marked requested."""
    waiting = [p for p, w in sorted(state.pending.items()) if not w.requested]
    if not waiting:
        return []
    busy: set[str] = set()
    if partitions_def is not None:
        statuses = instance.get_status_by_partition(key, waiting, partitions_def) or {}
        busy = {p for p, s in statuses.items() if s == dg.AssetPartitionStatus.IN_PROGRESS}
    ready = []
    room = []  # partitions whose rows wait for room, with no batch of their own
    freed = 0  # partitions whose batches were seen ended in this tick: room for as many
    running = False  # a batch of the asset was seen running
    for partition in waiting:
        waited = state.pending[partition]
        if partition in busy:
            continue
        if not waited.batches:
            if waited.waiting:
                room.append(partition)
            else:
                waited.requested = True
                ready.append(partition)
            continue
        if all(api.poll(b).state is not State.RUNNING for b in waited.batches):
            waited.requested = True
            ready.append(partition)
            freed += 1
        else:
            running = True
    now = time.time()
    for partition in sorted(room, key=lambda p: state.pending[p].at):  # longest waiting first
        waited = state.pending[partition]
        if freed:
            freed -= 1
        elif running or now - waited.at < _ROOM_RETRY_SECONDS:
            continue
        waited.requested = True
        ready.append(partition)
    return ready
