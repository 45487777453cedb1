"""Upkeep of a checkpoint at rest: what the CLI's ``verify`` and ``repair`` do.

``verify.py``: the problems of a checkpoint's files; ``repair.py``: setting them right.
"""
