"""The run loop: one run of one shard, from its lock to its result.

``runner.py``: ``run()`` and the work loop that calls the function; ``shard_run.py``: what
every work loop shares; ``sink.py``: flushes of rows done; ``lock.py``: the lease that makes a
run the only writer of its checkpoint.
"""
