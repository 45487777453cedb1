"""The demo (``scripts/demo`` runs ``examples.ticket_routing.demo``): one asset backfill of all
shards, launched by Dagster's daemon as one run; run again, it computes nothing.

Between the two runs an LLM example runs on the same ``dagster_home``, as the docs run the
examples one after another in one clone: it stores its own assets beside the demo's and changes
none of the demo's files (the asset keys all examples share: ``e2e/test_examples_together.py``).
It runs in this process, from the example's definitions imported under the demo's environment;
``e2e/test_llm_openai.py`` runs it through `dagster asset materialize`.
"""

from __future__ import annotations

import hashlib
import importlib
import re
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from examples.llm_openai import server

ROOT = Path(__file__).resolve().parents[2]
LLM = "examples.llm_openai.definitions"


def _demo(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "examples.ticket_routing.demo", "--timeout", "500"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    # Its own lines only: none of Dagster's log lines or warnings.
    for dagsters in (" - dagster - ", "Warning:"):
        assert dagsters not in done.stdout + done.stderr, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def _counts(output: str) -> tuple[int, int, int]:
    """Runs, tickets computed and tickets resumed, from the demo's closing line."""
    line = re.search(
        r"(\d+) run\(s\) \(0 failed\), 8 of 8 shards materialized, in [\d.]+ s: "
        r"([\d,]+) tickets, ([\d,]+) computed now, ([\d,]+) resumed",
        output,
    )
    assert line, output[-3000:]
    runs, total, computed, resumed = (int(g.replace(",", "")) for g in line.groups())
    assert total == 2000
    return runs, computed, resumed


def _materialize(env: dict[str, str], module: str, assets: list[str], partition: str) -> None:
    """Materialize ``assets`` of ``module`` in this process, on the instance of ``env``'s
    DAGSTER_HOME, the module imported anew under ``env`` (the examples read their settings from
    the environment when imported). Afterwards ``sys.modules`` holds what it held before, so the
    modules that imported the example keep sharing its objects."""
    saved = sys.modules.pop(module, None)
    try:
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            example = importlib.import_module(module)
            job = example.defs.resolve_implicit_global_asset_job_def()
            with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
                result = job.execute_in_process(
                    instance=instance,
                    partition_key=partition,
                    asset_selection=[dg.AssetKey(a) for a in assets],
                )
        assert result.success
    finally:
        sys.modules.pop(module, None)
        package, _, name = module.rpartition(".")
        if saved is not None:
            sys.modules[module] = saved
            setattr(sys.modules[package], name, saved)
        elif hasattr(sys.modules[package], name):
            delattr(sys.modules[package], name)


def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder``, by path, with the hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _latest(instance: dg.DagsterInstance, asset: str) -> dict[str, object]:
    """The run id and metadata of ``asset``'s latest materialization."""
    records = instance.fetch_materializations(dg.AssetKey(asset), limit=1).records
    assert records, asset
    event = records[0].asset_materialization
    assert event is not None
    return {"run_id": records[0].run_id, **{k: v.value for k, v in event.metadata.items()}}


@pytest.mark.timeout(1300)
@pytest.mark.slow
def test_the_demo_backfills_all_shards_in_one_run_and_computes_nothing_the_second_time(
    demo_env: dict[str, str],
) -> None:
    home, checkpoints = demo_env["DAGSTER_HOME"], Path(demo_env["CHECKPOINT_BASE_DIR"])
    first = _demo(demo_env)
    assert _counts(first) == (1, 2000, 0)
    demo_files = _files(checkpoints)
    assert "tickets.parquet" in demo_files and "ticket_routing/default/2-of-8.parquet" in demo_files
    with dg.DagsterInstance.from_config(home) as instance:
        demo_tickets = _latest(instance, "tickets")
    assert demo_tickets["rows"] == 2000

    # An LLM example on the same home: its own tickets and a shard, beside the demo's.
    env = demo_env | {"LLM_TICKETS": "300", "OPENAI_API_KEY": "local", "OPENAI_MODEL": "m"}
    with server.serve(latency_ms=1, seed=2) as base_url:
        env["OPENAI_BASE_URL"] = base_url
        _materialize(env, LLM, ["llm_tickets", "ticket_department"], "0-of-4")
    after = _files(checkpoints)
    assert {k: after[k] for k in demo_files} == demo_files  # the demo's files are untouched
    assert "llm_tickets.parquet" in after
    assert "ticket_department/default/0-of-4.parquet" in after
    with dg.DagsterInstance.from_config(home) as instance:
        assert _latest(instance, "llm_tickets")["rows"] == 300
        assert _latest(instance, "tickets") == demo_tickets

    # Run again, the demo keeps its tickets and resumes every row of every shard.
    second = _demo(demo_env)
    assert _counts(second) == (1, 0, 2000)
    assert "tickets: 2,000 stored, kept" in second
    with dg.DagsterInstance.from_config(home) as instance:
        runs = [r for r in instance.get_runs() if "dagster/backfill" in r.tags]
        backfills = {r.tags["dagster/backfill"] for r in runs}
        # Two backfills (one per demo run), each one run over the range of all 8 shards.
        assert len(runs) == len(backfills) == 2
        for run in runs:
            assert run.status == dg.DagsterRunStatus.SUCCESS
            assert run.tags["dagster/asset_partition_range_start"] == "0-of-8"
            assert run.tags["dagster/asset_partition_range_end"] == "7-of-8"
            assert instance.get_backfill(run.tags["dagster/backfill"]) is not None
