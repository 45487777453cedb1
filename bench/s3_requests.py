"""What a fast shard costs in S3 requests: a million rows through the engine at default settings
(``checkpoint_interval=16``, ``min_flush_seconds`` the store's 5 s) on a moto server in its own
process, counted by the store (``RunStats.requests``, the ``storage_requests/*`` metadata),
against ``Settings.request_budget``.

A count, not a time: but flushes come at most once per 5 s, so the count grows with the run's
duration (a busier machine makes a longer run, a few more flushes), not with its rows.

    python -m bench.run --only s3_requests --rows 1000000
"""

from __future__ import annotations

import time

from bench import data
from bench.remote import moto_process
from bench.report import Result
from checkpoint_assets.engine import Checkpoint, open_store, prepare, run


def s3_requests(rows: int) -> Result:
    result = Result("s3_requests", f"{rows:,} fast rows on S3 (moto), default settings")
    settings = data.settings(16)
    frame = data.make_input(rows)
    with moto_process() as (base_dir, options):
        checkpoint = Checkpoint(open_store(base_dir, options), "fast")
        started = time.monotonic()
        _, stats = run(data.score, prepare(frame, settings), checkpoint, settings, job=data.JOB)
        seconds = time.monotonic() - started
    total = sum(stats.requests.values())
    budget = settings.request_budget(stats.flushes, seconds)
    result.add("run", seconds, "s")
    result.add("flushes", stats.flushes)
    result.add("requests", total, limit=budget)
    for kind, n in sorted(stats.requests.items()):
        result.add(f"requests: {kind}", n)
    result.add("requests per million rows", total / rows * 1e6)
    result.details = {"rows": rows, "requests": stats.requests, "budget": budget}
    return result
