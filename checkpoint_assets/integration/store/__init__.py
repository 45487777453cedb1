"""How an asset is stored and read: the IO manager, its base directory, sources and shard
partitions.
"""
