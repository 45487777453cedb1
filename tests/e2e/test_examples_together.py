"""The examples run one after another in one clone: they share ``dagster_home`` and its
checkpoints, so no example may store over another's assets."""

from __future__ import annotations

import hashlib
import importlib
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from examples.llm_openai.server import Settings, serve_process

ROOT = Path(__file__).resolve().parents[2]
DEMO = "examples.ticket_routing.definitions"
# The examples whose docs run them on the repository's dagster_home (examples/dg_project is a
# project of its own, with its own home).
SHARING_A_HOME = (
    DEMO,
    "examples.llm_openai.definitions",
    "examples.llm_anthropic.definitions",
    "examples.llm_batch.definitions",
)


def _assets(module: str) -> dict[dg.AssetKey, dg.AssetsDefinition]:
    """The assets a module's definitions were given, by key."""
    defs = importlib.import_module(module).defs
    return {
        key: asset
        for asset in defs.assets or ()
        if isinstance(asset, dg.AssetsDefinition)
        for key in asset.keys
    }


def test_an_asset_key_two_examples_share_is_one_definition() -> None:
    by_module = {module: _assets(module) for module in SHARING_A_HOME}
    for i, first in enumerate(SHARING_A_HOME):
        for second in SHARING_A_HOME[i + 1 :]:
            for key in by_module[first].keys() & by_module[second].keys():
                # The same asset imported (the LLM examples' tickets), never a second one.
                assert by_module[first][key] is by_module[second][key], (first, second, key)
    assert not by_module[DEMO].keys() & set().union(*(by_module[m] for m in SHARING_A_HOME[1:]))


def _materialize(env: dict[str, str], module: str, *args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dagster", "asset", "materialize", "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder``, by path, with the hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _latest(home: str, asset: str, partition: str | None = None) -> dict[str, object]:
    with dg.DagsterInstance.from_config(home) as instance:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(
                asset_key=dg.AssetKey(asset),
                asset_partitions=[partition] if partition else None,
            ),
            limit=1,
        ).records
        assert records, (asset, partition)
        event = records[0].asset_materialization
        assert event is not None
        return {"run_id": records[0].run_id, **{k: v.value for k, v in event.metadata.items()}}


@pytest.mark.timeout(600)
def test_an_llm_example_after_the_demo_leaves_the_demos_tickets_and_checkpoints(
    demo_env: dict[str, str],
) -> None:
    home, checkpoints = demo_env["DAGSTER_HOME"], Path(demo_env["CHECKPOINT_BASE_DIR"])
    _materialize(demo_env, DEMO, "--select", "tickets")
    _materialize(demo_env, DEMO, "--select", "ticket_routing", "--partition", "2-of-8")
    demo_files = _files(checkpoints)
    demo_tickets = _latest(home, "tickets")
    assert demo_tickets["rows"] == 2000 and "tickets.parquet" in demo_files

    env = demo_env | {"LLM_TICKETS": "300", "OPENAI_API_KEY": "local", "OPENAI_MODEL": "m"}
    with serve_process(Settings(latency_ms=1, seed=2)) as base_url:
        env["OPENAI_BASE_URL"] = base_url
        _materialize(env, "examples.llm_openai.definitions", "--select", "llm_tickets")
        _materialize(
            env,
            "examples.llm_openai.definitions",
            *("--select", "ticket_department", "--partition", "0-of-4"),
        )

    # The example stored its own tickets and shard beside the demo's, which are untouched.
    after = _files(checkpoints)
    assert {k: after[k] for k in demo_files} == demo_files
    assert "llm_tickets.parquet" in after and _latest(home, "llm_tickets")["rows"] == 300
    assert _latest(home, "tickets") == demo_tickets
    # The demo's shard, run again, computes nothing: every row resumes from its checkpoint.
    _materialize(demo_env, DEMO, "--select", "ticket_routing", "--partition", "2-of-8")
    again = _latest(home, "ticket_routing", "2-of-8")
    assert again["rows_computed"] == 0 and again["rows_resumed"] == again["rows_total"] > 0
