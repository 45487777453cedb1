"""Each setting is declared once, as a field of ``AssetSettings`` (type, default, meaning):
``checkpointed_asset`` takes it as a keyword argument and ``CheckpointedAssetComponent`` as a YAML
attribute with the same default and description, and a value given in YAML reaches the engine."""

from __future__ import annotations

import inspect
import json
from dataclasses import fields
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from checkpoint_assets import CheckpointedAssetComponent, CheckpointIOManager, checkpointed_asset
from checkpoint_assets.engine.fields import DOC
from checkpoint_assets.engine.settings import AssetSettings
from checkpoint_assets.integration.define.arguments import AssetArguments

SETTINGS = [f.name for f in fields(AssetSettings)]
# Settings whose YAML form is a mapping of their own (the component resolves it to the value).
OWN_FORM = {"budget"}


@pytest.mark.parametrize("name", SETTINGS)
def test_every_setting_is_a_keyword_argument_of_the_decorator_with_its_default(name: str) -> None:
    [field] = [f for f in fields(AssetSettings) if f.name == name]
    parameter = inspect.signature(checkpointed_asset).parameters[name]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
    assert parameter.default == field.default


@pytest.mark.parametrize("name", [n for n in SETTINGS if n not in OWN_FORM])
def test_every_setting_is_a_component_attribute_with_its_default_and_meaning(name: str) -> None:
    [field] = [f for f in fields(AssetSettings) if f.name == name]
    assert CheckpointedAssetComponent.model_fields[name].default == field.default
    schema = CheckpointedAssetComponent.model().model_json_schema()["properties"][name]
    assert schema["description"] == field.metadata[DOC]


def test_help_lists_every_argument_with_its_meaning() -> None:
    doc = checkpointed_asset.__doc__ or ""
    for field in fields(AssetArguments):
        first_words = " ".join(field.metadata[DOC].split()[:3])
        assert f"{field.name}: {first_words}" in " ".join(doc.split()), field.name


def component(yaml: str) -> dg.Definitions:
    base = "fn: helpers.jobs:route\nsource: tickets\nid_column: ticket_id\nname: routed\n"
    built = CheckpointedAssetComponent.resolve_from_yaml(base + yaml)
    assert isinstance(built, CheckpointedAssetComponent)
    return built.build_defs(dg.ComponentTree.for_test().load_context)


def test_a_setting_out_of_range_in_yaml_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="max_attempts must be at least 1, got 0"):
        component("max_attempts: 0\n")


def test_settings_given_in_yaml_reach_the_run(tmp_path: Path) -> None:
    rows = pl.DataFrame({"ticket_id": range(10), "body": [f"b{i}" for i in range(10)]})

    @dg.asset
    def tickets() -> pl.DataFrame:
        return rows

    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        return batch.select("ticket_id", tokens=pl.lit(3))

    built = CheckpointedAssetComponent.resolve_from_yaml(
        "fn: helpers.jobs:route\nsource: tickets\nid_column: ticket_id\nname: routed\n"
        "usage_columns: [tokens]\non_input_change: recompute\n"
    )
    assert isinstance(built, CheckpointedAssetComponent)
    built.fn = routed
    io_manager = {"io_manager": CheckpointIOManager(base_dir=str(tmp_path))}
    defs = dg.Definitions.merge(
        built.build_defs(dg.ComponentTree.for_test().load_context),
        dg.Definitions(assets=[tickets], resources=io_manager),
    )
    result = dg.materialize(
        [defs.resolve_assets_def("tickets"), defs.resolve_assets_def("routed")],
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    [event] = result.asset_materializations_for_node("routed")
    assert event.metadata["usage/tokens"].value == 30  # usage_columns, from the YAML


def test_dagsters_own_asset_options_reach_the_asset_and_its_step(tmp_path: Path) -> None:
    @dg.asset
    def tickets() -> pl.DataFrame:
        return pl.DataFrame({"ticket_id": range(4), "body": ["b"] * 4})

    condition = dg.AutomationCondition.eager()

    @checkpointed_asset(
        source="tickets",
        id_column="ticket_id",
        owners=["team:ml"],
        kinds=["openai"],
        op_tags={"dagster-k8s/config": {"container_config": {}}},
        retry_policy=dg.RetryPolicy(max_retries=2),
        automation_condition=condition,
    )
    def routed(batch: pl.DataFrame) -> pl.DataFrame:
        return batch.select("ticket_id", department=pl.lit("billing"))

    spec = next(iter(routed.specs))
    assert spec.owners == ["team:ml"]
    assert spec.kinds == {"polars", "parquet", "openai"}
    assert spec.automation_condition == condition
    assert json.loads(routed.op.tags["dagster-k8s/config"]) == {"container_config": {}}
    assert routed.op.retry_policy == dg.RetryPolicy(max_retries=2)
    result = dg.materialize(
        [tickets, routed],
        instance=dg.DagsterInstance.ephemeral(),
        resources={"io_manager": CheckpointIOManager(base_dir=str(tmp_path))},
    )
    assert result.success


def test_owners_kinds_and_op_tags_are_component_attributes() -> None:
    defs = component("owners: [team:ml]\nkinds: [openai]\nop_tags: {queue: gpu}\n")
    [routed] = [a for a in defs.assets or () if isinstance(a, dg.AssetsDefinition)]
    spec = next(iter(routed.specs))
    assert spec.owners == ["team:ml"]
    assert "openai" in spec.kinds
    assert routed.op.tags["queue"] == "gpu"
