"""Sharding: which shard each row belongs to.

``hashing.py``: row and input hashes; ``scheme.py``: shards and partitions;
``keyed.py``: a table ordered by its shard key, so a range shard reads only its rows.
"""
