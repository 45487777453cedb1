"""checkpoint-assets: resumable, sharded, row-wise batch jobs as Dagster assets.

>>> import checkpoint_assets
>>> checkpoint_assets.shard_partitions(4).get_partition_keys()
['0-of-4', '1-of-4', '2-of-4', '3-of-4']
"""

import importlib
from typing import TYPE_CHECKING, Any

from checkpoint_assets.engine.calls.budget import Budget, Price
from checkpoint_assets.engine.calls.refusals import RetryAfter
from checkpoint_assets.engine.errors import (
    BatchesPendingError,
    BudgetExceededError,
    CheckpointError,
    CorruptCheckpointError,
    FunctionError,
    InputChangedError,
    InvalidIdsError,
    JobChangedError,
    JobMismatchError,
    LockHeldError,
    MissingColumnsError,
    NewerFormatError,
    OutageError,
    QuotaExhaustedError,
    RunStoppedError,
    StorageError,
    TooManyFailuresError,
)
from checkpoint_assets.engine.providers.submissions import BatchProvider
from checkpoint_assets.engine.settings import LossBound, OnInputChange, loss_bound

if TYPE_CHECKING:
    from checkpoint_assets.integration.define.asset import checkpointed_asset
    from checkpoint_assets.integration.define.checks import checkpoint_checks
    from checkpoint_assets.integration.define.component import CheckpointedAssetComponent
    from checkpoint_assets.integration.define.provider_asset import (
        ProviderBatchRunConfig,
        provider_batch_asset,
    )
    from checkpoint_assets.integration.run.run_config import CheckpointRunConfig
    from checkpoint_assets.integration.store.io_manager import CheckpointIOManager
    from checkpoint_assets.integration.store.partitions import shard_partitions
    from checkpoint_assets.integration.watch.global_resume import global_resume_asset
    from checkpoint_assets.integration.watch.provider_sensor import provider_batches_sensor
    from checkpoint_assets.integration.watch.sensor import failed_partitions_sensor
    from checkpoint_assets.resources import (
        AnthropicResource,
        AzureOpenAIResource,
        GeminiResource,
        OpenAIResource,
    )
    from checkpoint_assets.resources.bedrock import BedrockResource

# The Dagster glue is imported on first use, so that the engine and the `checkpoint-assets` CLI
# start without importing Dagster (seconds of start-up).
_LAZY = {
    "CheckpointRunConfig": "checkpoint_assets.integration.run.run_config",
    "checkpointed_asset": "checkpoint_assets.integration.define.asset",
    "checkpoint_checks": "checkpoint_assets.integration.define.checks",
    "CheckpointedAssetComponent": "checkpoint_assets.integration.define.component",
    "global_resume_asset": "checkpoint_assets.integration.watch.global_resume",
    "CheckpointIOManager": "checkpoint_assets.integration.store.io_manager",
    "shard_partitions": "checkpoint_assets.integration.store.partitions",
    "ProviderBatchRunConfig": "checkpoint_assets.integration.define.provider_asset",
    "provider_batch_asset": "checkpoint_assets.integration.define.provider_asset",
    "provider_batches_sensor": "checkpoint_assets.integration.watch.provider_sensor",
    "failed_partitions_sensor": "checkpoint_assets.integration.watch.sensor",
    "AnthropicResource": "checkpoint_assets.resources",
    "AzureOpenAIResource": "checkpoint_assets.resources",
    "BedrockResource": "checkpoint_assets.resources.bedrock",
    "GeminiResource": "checkpoint_assets.resources",
    "OpenAIResource": "checkpoint_assets.resources",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'checkpoint_assets' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # `dg` finds the Component by listing this module's members: list the lazy ones too.
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AnthropicResource",
    "AzureOpenAIResource",
    "BatchProvider",
    "BatchesPendingError",
    "BedrockResource",
    "Budget",
    "BudgetExceededError",
    "CheckpointError",
    "CheckpointIOManager",
    "CheckpointRunConfig",
    "CheckpointedAssetComponent",
    "CorruptCheckpointError",
    "FunctionError",
    "GeminiResource",
    "InputChangedError",
    "InvalidIdsError",
    "JobChangedError",
    "JobMismatchError",
    "LockHeldError",
    "LossBound",
    "MissingColumnsError",
    "NewerFormatError",
    "OnInputChange",
    "OpenAIResource",
    "OutageError",
    "Price",
    "ProviderBatchRunConfig",
    "QuotaExhaustedError",
    "RetryAfter",
    "RunStoppedError",
    "StorageError",
    "TooManyFailuresError",
    "checkpoint_checks",
    "checkpointed_asset",
    "failed_partitions_sensor",
    "global_resume_asset",
    "loss_bound",
    "provider_batch_asset",
    "provider_batches_sensor",
    "shard_partitions",
]
