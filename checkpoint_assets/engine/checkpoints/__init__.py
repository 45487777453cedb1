"""One checkpoint's files: their names, contents, reads, merges and damage.

``layout.py``: every file name under a checkpoint root; ``parquet.py`` and ``meta.py``: what
is stored; ``checkpoint.py`` and ``compaction.py``: reads, merges and compaction;
``damage.py``: damaged files; ``gaps.py``: parts listed when listings lag.
"""
