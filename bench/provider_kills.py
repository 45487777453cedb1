"""Every provider of the contract suite, killed: a 4-shard batch backfill whose shards are
SIGKILLed after the upload, after the create and during the download (the fourth runs through),
then run again to the end; and a hybrid run past its deadline. Counts come from each provider's
fake, on its side.

    python -m bench.provider_kills                       # 20,000 rows, every case
    python -m bench.provider_kills --rows 2000 --cases openai,azure_openai

For each provider it prints: requests processed (paid) and rows, the most times one ``custom_id``
was processed, batches created, rows stored and rows stored twice; for the hybrid run, rows paid
(by batch + online) and rows stored. The cases and the kill child are the tests'
(``tests/helpers/provider_cases.py``, ``tests/helpers/provider_kill_child.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(_TESTS))

import polars as pl  # noqa: E402
from helpers import provider_kill_child  # noqa: E402
from helpers.provider_cases import CASES, ProviderCase  # noqa: E402

from checkpoint_assets.engine import (  # noqa: E402
    Checkpoint,
    Settings,
    open_store,
    prepare,
    run,
)
from checkpoint_assets.engine.providers.job import Mode, ProviderJob, Way  # noqa: E402
from checkpoint_assets.engine.providers.provider_batches import provider_loop  # noqa: E402
from examples.llm_batch import jobs  # noqa: E402

POINTS = ("after_upload", "after_create", "downloading", "none")


def kill(case: ProviderCase, urls: Any, base_dir: str, rows: int, point: str) -> int | None:
    return provider_kill_child.forked(case, urls, base_dir, rows, point)[0]


def stored(base_dir: str) -> tuple[int, int]:
    """Rows stored, and rows stored more than once across the checkpoint's files."""
    checkpoint = Checkpoint(open_store(base_dir), provider_kill_child.NAME)
    files = checkpoint.data_files()
    ids = pl.concat([pl.read_parquet(f).select("id") for f in files]).get_column("id")
    return checkpoint.load("id").rows.height, ids.len() - ids.n_unique()


def backfill(case: ProviderCase, rows: int, root: str) -> dict[str, Any]:
    per_shard = rows // len(POINTS)
    with case.start(jobs.Settings(processing_delay=1.0), time.time) as fake:
        codes = []
        for shard, point in enumerate(POINTS):
            base_dir = f"{root}/{case.name}-{shard}"
            codes.append(kill(case, fake.urls, base_dir, per_shard, point))
            provider_kill_child.run_shard(case, fake.urls, base_dir, per_shard)
        shards = [stored(f"{root}/{case.name}-{s}") for s in range(len(POINTS))]
        counted, processed = fake.counts(), fake.processed()
    return {
        "exit codes": codes,  # -9: killed
        "rows": per_shard * len(POINTS),
        "processed": counted["processed"],
        "most per custom_id": max(processed.values()),
        "creates": counted["creates"],
        "stored": sum(s[0] for s in shards),
        "stored twice": sum(s[1] for s in shards),
    }


def hybrid(case: ProviderCase, rows: int, root: str) -> dict[str, Any]:
    settings = Settings(id_column="id", input_columns=("body",), progress_seconds=3600.0)
    texts = ("I was charged twice, please refund me", "hello")
    df = pl.DataFrame({"id": range(rows), "body": [texts[i % 2] for i in range(rows)]})
    with case.start(jobs.Settings(processing_delay=6.0), time.time) as fake:
        with case.resource(fake.urls).process_config_and_initialize_cm() as resource:
            job = ProviderJob(
                case.adapter(resource),
                lambda row: case.request(row["body"]),
                case.parse,
                poll_seconds=0.05,
                max_poll_seconds=0.2,
                way=Way(Mode.hybrid, 0.5),
                send=resource.sender(),
            )
            checkpoint = Checkpoint(open_store(f"{root}/{case.name}-hybrid"), "hybrid/default/all")
            run(
                provider_loop(job),
                prepare(df, settings),
                checkpoint,
                settings,
                job={"hybrid": 1},
            )
        counted = fake.counts()
        online = fake.online()
    rows_stored = checkpoint.load("id").rows.height
    return {
        "rows": rows,
        "paid by batch": counted["processed"],
        "paid online": online,
        "paid": counted["processed"] + online,
        "stored": rows_stored,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--hybrid-rows", type=int, default=2_000)
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    args = parser.parse_args()
    for variable, secret in {k: v for c in CASES for k, v in c.secrets.items()}.items():
        os.environ[variable] = secret
    chosen = [c for c in CASES if c.name in args.cases.split(",")]
    with tempfile.TemporaryDirectory() as root:
        for case in chosen:
            print(case.name, "backfill", backfill(case, args.rows, root), flush=True)
            print(case.name, "hybrid", hybrid(case, args.hybrid_rows, root), flush=True)


if __name__ == "__main__":
    main()
