"""The examples run one after another in one clone: they share ``dagster_home`` and its
checkpoints, so no example may store over another's assets. Here: the asset keys they share.
Run one after another, an LLM example leaves the demo's files alone: ``e2e/test_demo.py``."""

from __future__ import annotations

import importlib

import dagster as dg

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
