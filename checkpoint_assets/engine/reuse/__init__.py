"""The result store: results kept by what was asked, not by where they were stored.

A result is keyed by its *scope* (the function's fingerprint and the job settings that change
results) and the row's *content key* (its input columns, the id left out: ``hashing.py``). Any
asset, tag, shard scheme or id asking the same takes it instead of calling again.

- ``layout.py``: where results live (scope, bucket, file names) and the key columns.
- ``store.py``: ``ResultStore``, adding results and looking keys up.
- ``contribution.py``: what one shard adds, once its parts are durable.
- ``upkeep.py``: cleaning by age and size, merging small files.
"""
