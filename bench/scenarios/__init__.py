"""The scenarios of issue 4, each measured against a baseline in the same run, one module a
theme: ``overhead`` (through Dagster), ``calls`` (per call, hashing), ``stored`` (resume,
memory, compaction), ``ray`` (Ray Data's checkpointing), ``distribatch`` (distribatch's)."""

from bench.scenarios.calls import hashing_speed, per_call
from bench.scenarios.common import Sizes
from bench.scenarios.distribatch import distribatch_peer
from bench.scenarios.overhead import overhead
from bench.scenarios.ray import ray_data
from bench.scenarios.stored import compaction, resume

__all__ = [
    "Sizes",
    "compaction",
    "distribatch_peer",
    "hashing_speed",
    "overhead",
    "per_call",
    "ray_data",
    "resume",
]
