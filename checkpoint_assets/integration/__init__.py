"""The Dagster side, in rooms from top to bottom (each imports only the rooms below it):

- ``define``: the decorators, their arguments, asset checks and the Component;
- ``run``: one materialization of an asset over its shards, and its run config;
- ``watch``: the sensors, spend, pending provider batches and global resume;
- ``store``: the IO manager, sources and shard partitions;
- ``metadata``: the names and tables every room records.

``deploy`` holds glue a deployment names in its instance config; nothing else imports it.
"""
