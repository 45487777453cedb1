"""What an asset with a budget spent, in the Dagster instance: read before a run, recorded after.

Per shard (partition), each materialization records (``metadata.py`` names the keys):

- ``cost_usd``: what this run's calls on the shard cost; ``cost_by_model``: the same by model;
- ``cost_shard_total_usd``: what the shard cost over every run, the previous record's plus this
  run's;
- ``cost_asset_total_usd``: what the asset cost over every shard and run, as of this run.

A run may spend and then fail, because the budget stopped it or for any other reason. It then
records the same keys as an ``AssetObservation`` of the shard, since a failed step carries no
materialization. Its spend counts.

What the asset spent before a run is the sum, over its shards, of the latest
``cost_shard_total_usd``. Reading it takes two queries of the event log: the latest
materialization and the latest observation of each partition. A shard whose latest event lacks
the key gets a short look back. Nothing is read from or written to a file that every shard
rewrites.

With ``max_asset_cost``, a running shard also records what it spent so far: an observation with
``cost_shard_total_usd``. It reads the other shards' totals every ``REFRESH_SECONDS``. So shards
running at once see each other's spend within that time. The asset's total passes the limit by
at most what they spend in that time, plus their calls in flight.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import dagster as dg

from checkpoint_assets.engine.calls.budget import Spend
from checkpoint_assets.engine.errors import BudgetExceededError
from checkpoint_assets.integration import metadata as md

STOPPED_BY_TAG = "checkpoint_assets/stopped_by"  # "budget" on a run the budget stopped
_LOOK_BACK = 20  # events of a shard read when its latest one carries no cost
REFRESH_SECONDS = 30.0  # how often a running shard shows its spend and reads the others'


class AssetSpend:
    """The spend of one run of an asset: the shared tally, and what each shard cost before."""

    def __init__(
        self, context: dg.AssetExecutionContext, spend: Spend, keys: Sequence[str | None]
    ) -> None:
        self.context = context
        self.spend = spend
        self.partitioned = context.assets_def.partitions_def is not None
        self.shards = spent_by_shard(context.instance, context.asset_key, self.partitioned)
        self.ours = {k or "": self.shards.get(k or "", 0.0) for k in keys}  # before this run
        spend.asset_spent_before = sum(self.shards.values())
        if spend.budget.max_asset_cost is not None:
            spend.refresh, spend.refresh_seconds = self.refresh, REFRESH_SECONDS
        self._mark: tuple[float, dict[str, float]] = (0.0, {})
        self._current: str | None = None
        self._shown = 0.0  # this shard's spend its last observation showed
        self.done: dict[str | None, dict[str, Any]] = {}  # the cost keys of each shard that ran

    def start(self, partition: str | None = None) -> None:
        """A shard starts: what the tally holds now is the other shards'."""
        self._mark = (self.spend.spent, dict(self.spend.by_model))
        self._current, self._shown = partition, 0.0

    def refresh(self) -> None:
        """While a shard runs, with ``max_asset_cost``: exchange spend with the other shards.

        Show what this shard spent so far (an observation, only when it changed). Take what the
        others spent meanwhile.
        """
        cost = self.spend.spent - self._mark[0]
        key = self._current or ""
        if cost > self._shown:
            self._shown = cost
            self.context.log_event(
                dg.AssetObservation(
                    asset_key=self.context.asset_key,
                    partition=self._current,
                    metadata=md.declared(
                        {md.COST_USD: cost, md.COST_SHARD_TOTAL_USD: self.ours[key] + cost},
                        md.OBSERVATION,
                    ),
                )
            )
        read = spent_by_shard(self.context.instance, self.context.asset_key, self.partitioned)
        self.shards.update({p: v for p, v in read.items() if p not in self.ours})
        others = sum(v for p, v in self.shards.items() if p not in self.ours)
        self.spend.asset_spent_before = others + sum(self.ours.values())

    def finish(self, partition: str | None) -> None:
        """A shard ends: what the tally gained since :meth:`start` is its cost in this run."""
        spent, by_model = self._mark
        cost = self.spend.spent - spent
        models = {m: round(v - by_model.get(m, 0.0), 9) for m, v in self.spend.by_model.items()}
        key = partition or ""
        self.shards[key] = self.ours.get(key, 0.0) + cost
        self.done[partition] = {
            md.COST_USD: round(cost, 9),
            md.COST_BY_MODEL: dg.MetadataValue.json({m: v for m, v in models.items() if v}),
            md.COST_SHARD_TOTAL_USD: round(self.shards[key], 9),
        }
        self.start(partition)

    def metadata(self, partition: str | None) -> dict[str, Any]:
        """The cost keys of ``partition``'s materialization (after :meth:`finish`)."""
        total = round(sum(self.shards.values()), 9)
        return md.declared(
            {**self.done[partition], md.COST_ASSET_TOTAL_USD: total}, md.MATERIALIZATION
        )

    @contextmanager
    def recorded_on_failure(self) -> Iterator[None]:
        """On a failure inside, record what each shard of the run spent as an observation.

        A failed step materializes none of them. When the budget stopped the run, tag it, so
        that ``failed_partitions_sensor`` does not retry it.
        """
        try:
            yield
        except BaseException as error:
            if isinstance(error, BudgetExceededError):
                tags = {STOPPED_BY_TAG: "budget"}
                self.context.instance.add_run_tags(self.context.run.run_id, tags)
            for partition, cost in self.done.items():
                if cost[md.COST_USD]:  # a shard that spent nothing has nothing to count
                    self.context.log_event(
                        dg.AssetObservation(
                            asset_key=self.context.asset_key,
                            partition=partition,
                            metadata=md.declared(
                                {
                                    **self.metadata(partition),
                                    md.STOPPED_BY: type(error).__name__,
                                },
                                md.OBSERVATION,
                            ),
                        )
                    )
            raise


def spent_by_shard(
    instance: dg.DagsterInstance, key: dg.AssetKey, partitioned: bool
) -> dict[str, float]:
    """The latest ``cost_shard_total_usd`` of every shard of ``key`` ("" when unpartitioned)."""
    if not partitioned:
        value = _look_back(instance, dg.AssetRecordsFilter(key))
        return {} if value is None else {"": value}
    latest: dict[str, int] = {}
    kinds = (dg.DagsterEventType.ASSET_MATERIALIZATION, dg.DagsterEventType.ASSET_OBSERVATION)
    for kind in kinds:
        for partition, storage_id in instance.get_latest_storage_id_by_partition(key, kind).items():
            latest[partition] = max(latest.get(partition, 0), storage_id)
    found = _values(instance, key, sorted(latest.values()))
    out: dict[str, float] = {}
    for partition, storage_id in latest.items():
        value = found.get(storage_id)
        if value is None:  # its latest event carries no cost: look further back
            value = _look_back(instance, dg.AssetRecordsFilter(key, asset_partitions=[partition]))
        if value is not None:
            out[partition] = value
    return out


def _values(
    instance: dg.DagsterInstance, key: dg.AssetKey, storage_ids: Sequence[int]
) -> dict[int, float]:
    """The cost totals of these events, by storage id."""
    out: dict[int, float] = {}
    for start in range(0, len(storage_ids), 1000):
        chunk = storage_ids[start : start + 1000]
        where = dg.AssetRecordsFilter(asset_key=key, storage_ids=chunk)
        for fetch in (instance.fetch_materializations, instance.fetch_observations):
            for record in fetch(where, limit=len(chunk)).records:
                value = _total(record)
                if value is not None:
                    out[record.storage_id] = value
    return out


def _look_back(instance: dg.DagsterInstance, where: dg.AssetRecordsFilter) -> float | None:
    """The newest cost total among the latest events that ``where`` selects."""
    newest: tuple[int, float] | None = None
    for fetch in (instance.fetch_materializations, instance.fetch_observations):
        for record in fetch(where, limit=_LOOK_BACK).records:  # newest first
            value = _total(record)
            if value is not None:
                if newest is None or record.storage_id > newest[0]:
                    newest = (record.storage_id, value)
                break
    return None if newest is None else newest[1]


def _total(record: dg.EventLogRecord) -> float | None:
    event = record.asset_materialization or record.asset_observation
    value = None if event is None else event.metadata.get(md.COST_SHARD_TOTAL_USD)
    return None if value is None else float(md.plain(value))
