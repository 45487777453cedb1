"""How an asset runs: one materialization over its shards, its run config, dry runs, and what a
failed run reports.
"""
