"""The Dagster side: IO manager, asset decorator, shard partitions, sensor, global resume."""
