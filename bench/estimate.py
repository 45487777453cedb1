"""The estimate against the real run of the same job: rows, tokens and cost.

One shard (``0-of-2``) of ``--rows`` texts through ``OpenAIResource``, the assets of the
estimate's tests (``tests/helpers/estimate_defs.py``): online against the local chat server,
then as provider batches against the local batch provider. Each: a dry run, then the real run on
the same checkpoint. Printed per path: the estimate, what the server counted, and the gap.

The local servers count a token per whitespace-separated word. ``--english`` gives the demo's
ticket texts instead of words of three letters: the gap then shows bytes/4 against a count of
words, not against a provider's tokenizer.

    python -m bench.estimate                      # 2,000 rows
    python -m bench.estimate --english
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``examples`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The estimate's tests hold the assets measured here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import polars as pl
from helpers.estimate_defs import Job, batch_asset, materialized, online_asset, texts

from examples.llm_batch import provider
from examples.llm_openai import server
from examples.ticket_routing.data import generate_tickets

SHARD = "0-of-2"


def _gap(estimated: float | None, real: float) -> str:
    if estimated is None or not real:
        return f"estimate {estimated}, real {real}"
    return f"estimate {estimated:,.6g}, real {real:,.6g} ({estimated / real - 1:+.1%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--english", action="store_true", help="the demo's ticket texts")
    args = parser.parse_args()
    df = texts(args.rows)
    if args.english:
        tickets = generate_tickets(args.rows)
        df = tickets.select(pl.col("ticket_id").alias("id"), pl.col("body").alias("text"))
    batches = lambda: provider.serve(provider.Settings())  # noqa: E731
    paths = (
        ("online", server.serve, online_asset, server.stats, "prompt_tokens", "completion_tokens"),
        ("batches", batches, batch_asset, provider.stats, "input_tokens", "output_tokens"),
    )
    for name, serve, asset, stats, tokens_in, tokens_out in paths:
        with serve() as url, tempfile.TemporaryDirectory() as tmp:
            job = Job(Path(tmp), url, asset())
            job.df = df
            found = job.estimate(SHARD)
            done = materialized(job.run(SHARD))
            counted = stats(url)
            cost = found.cost_online_usd if name == "online" else found.cost_batch_usd
            print(f"{name} ({found.tokenizer}):")
            print(f"  rows to compute: {_gap(found.rows_to_compute, done['rows_computed'])}")
            print(f"  input tokens:    {_gap(found.input_tokens, counted[tokens_in])}")
            print(f"  output tokens:   {_gap(found.output_tokens, counted[tokens_out])}")
            print(f"  cost USD:        {_gap(cost, done['cost_usd'])}")


if __name__ == "__main__":
    main()
