"""Benchmarks of checkpoint-assets against same-run baselines (see ``bench/run.py``)."""
