"""What an asset's definition fixes for each of its runs: how its rows are computed (``Calls``)
and the asset's own settings (``Definition``). The decorators of ``define`` build them once;
each run reads them.

No ``from __future__ import annotations`` here: Dagster reads the run config class at runtime.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import dagster as dg

from checkpoint_assets.engine.calls.batches import PerRow
from checkpoint_assets.engine.calls.caller import BatchFn
from checkpoint_assets.engine.loop.shard_run import OwnLoop
from checkpoint_assets.engine.settings import Settings
from checkpoint_assets.integration.run.run_config import CheckpointRunConfig


@dataclass(frozen=True)
class Calls:
    """How an asset's rows are computed.

    - ``resources``: the resources it needs (their fingerprints join its code's);
    - ``bind``: what it calls each run: the function with its resources, or a provider job
      with its own work loop (``provider_batches.provider_loop``);
    - ``request``: a row's request body, of a request/parse asset (a dry run counts its tokens);
    - ``parse``: a request/parse asset's that keeps its answers; it reads the answers of rows
      taken from the result store.
    """

    resources: tuple[str, ...]
    code: dict[str, str]
    bind: Callable[[dg.AssetExecutionContext, Any], BatchFn | PerRow | OwnLoop]
    config: type[CheckpointRunConfig] = CheckpointRunConfig
    request: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None
    parse: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None


@dataclass(frozen=True)
class Definition:
    """An asset as its runs need it.

    - ``calls``: how its rows are computed;
    - ``settings``: its settings before a run's config applies;
    - ``source_key``: the asset it reads its rows from;
    - ``io_manager_key``, ``code_version``, ``reuse``: the decorator's arguments of those names.
    """

    calls: Calls
    settings: Settings
    source_key: dg.AssetKey
    io_manager_key: str
    code_version: str | None
    reuse: bool | None
