import dagster as dg

from checkpoint_assets import CheckpointIOManager


@dg.definitions
def resources() -> dg.Definitions:
    """The project's IO manager: checkpoints (and the tickets table) as Parquet.

    Without base_dir they live in $DAGSTER_HOME/checkpoints; production would point it at
    object storage, e.g. CheckpointIOManager(base_dir="s3://my-bucket/checkpoints").
    """
    return dg.Definitions(resources={"io_manager": CheckpointIOManager()})
