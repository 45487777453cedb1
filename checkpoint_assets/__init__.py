"""checkpoint-assets: resumable, sharded, row-wise batch jobs as Dagster assets.

>>> import checkpoint_assets
>>> checkpoint_assets.shard_partitions(4).get_partition_keys()
['0-of-4', '1-of-4', '2-of-4', '3-of-4']
"""

from checkpoint_assets.engine.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InputChangedError,
    InvalidIdsError,
    JobMismatchError,
    LockHeldError,
    OutageError,
    StorageError,
    TooManyFailuresError,
)
from checkpoint_assets.integration.asset import CheckpointRunConfig, checkpointed_asset
from checkpoint_assets.integration.checks import checkpoint_checks
from checkpoint_assets.integration.component import CheckpointedAssetComponent
from checkpoint_assets.integration.global_resume import global_resume_asset
from checkpoint_assets.integration.io_manager import CheckpointIOManager
from checkpoint_assets.integration.partitions import shard_partitions
from checkpoint_assets.integration.sensor import failed_partitions_sensor

__all__ = [
    "CheckpointError",
    "CheckpointIOManager",
    "CheckpointRunConfig",
    "CheckpointedAssetComponent",
    "CorruptCheckpointError",
    "InputChangedError",
    "InvalidIdsError",
    "JobMismatchError",
    "LockHeldError",
    "OutageError",
    "StorageError",
    "TooManyFailuresError",
    "checkpoint_checks",
    "checkpointed_asset",
    "failed_partitions_sensor",
    "global_resume_asset",
    "shard_partitions",
]
