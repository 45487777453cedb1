"""Calls to the user's function: batches, retries, pacing, rate limits and what calls cost.

``batches.py``: what a call takes and returns; ``caller.py``: one call with its retries;
``workers.py``: threads or asyncio tasks; ``throttle.py``, ``adaptation.py``, ``gate.py``,
``refusals.py``, ``pacing.py`` and ``shares.py``: rate limits; ``budget.py``: prices, limits and
the spend of a run.
"""
