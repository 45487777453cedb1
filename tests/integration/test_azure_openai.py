"""Azure OpenAI: what differs from OpenAI, against the fake Azure OpenAI resource
(``examples/llm_batch/azure_api.py``) through the ``openai`` package's Azure clients. What every
provider must hold is the contract suite's (``test_provider_contract.py``, case
``azure_openai``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dagster as dg
import polars as pl
import pytest
from helpers import azure_token
from helpers.jobs import ASSET, stats, step_error

from checkpoint_assets import AzureOpenAIResource, CheckpointIOManager, provider_batch_asset
from examples.llm_batch import azure_api
from examples.llm_batch.jobs import Settings
from examples.llm_batch.online import Both


@pytest.fixture
def azure() -> Iterator[tuple[str, Both]]:
    with azure_api.serve(Settings()) as served:
        yield served


def parse(body: dict[str, Any]) -> dict[str, Any]:
    return {"answer": body["choices"][0]["message"]["content"]}


def run(resource: AzureOpenAIResource, tmp_path: Any, **config: Any) -> dg.ExecuteInProcessResult:
    @dg.asset(name="tickets", io_manager_key="source_io")
    def tickets() -> pl.DataFrame:
        return pl.DataFrame({"id": range(20), "body": ["hello"] * 20})

    @provider_batch_asset(
        name=ASSET,
        source="tickets",
        id_column="id",
        input_columns=["body"],
        parse=parse,
        provider="azure",
        poll_seconds=0.05,
        max_poll_seconds=0.2,
    )
    def routed(row: dict[str, Any]) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": row["body"]}]}

    return dg.materialize(
        [tickets, routed],
        resources={
            "io_manager": CheckpointIOManager(base_dir=str(tmp_path / "checkpoints")),
            "source_io": dg.InMemoryIOManager(),  # type: ignore[no-untyped-call]
            "azure": resource,
        },
        run_config={"ops": {ASSET: {"config": config}}},
        raise_on_error=False,
    )


def resource(endpoint: str, **kw: Any) -> AzureOpenAIResource:
    options: dict[str, Any] = {
        "azure_endpoint": endpoint,
        "deployment": "gpt-4o-mini",
        "batch_deployment": "gpt-4o-mini-batch",
    }
    return AzureOpenAIResource(**(options | kw))


def test_an_entra_id_token_provider_signs_online_and_batch_requests(
    azure: tuple[str, Both], tmp_path: Any
) -> None:
    endpoint, both = azure
    signed = resource(endpoint, token_provider="helpers.azure_token:token")
    azure_token.CALLS.clear()
    batch = run(signed, tmp_path, checkpoint_tag="batch")
    online = run(signed, tmp_path, checkpoint_tag="online", mode="online")
    assert batch.success and online.success, step_error(online)
    assert both.provider.snapshot()["processed"] == 20 and both.chat.snapshot()["ok"] == 20
    assert len(azure_token.CALLS) >= 20  # asked before every request
    assert stats(online)["rows_computed"] == 20


def test_online_requests_go_to_the_deployment_and_batches_to_the_batch_deployment(
    azure: tuple[str, Both], tmp_path: Any
) -> None:
    endpoint, both = azure
    # The fake refuses batches on a standard deployment and online requests on a batch one.
    swapped = resource(
        endpoint, api_key=azure_api.KEY, deployment="gpt-4o-mini-batch", batch_deployment=None
    )
    online = run(swapped, tmp_path, checkpoint_tag="online", mode="online")
    assert not online.success
    assert "online requests go to a standard deployment" in step_error(online)
    batch = run(resource(endpoint, api_key=azure_api.KEY, batch_deployment="gpt-4o-mini"), tmp_path)
    assert not batch.success
    assert "is no Global Batch deployment" in step_error(batch)
    assert both.provider.snapshot()["submitted"] == 0 and both.chat.snapshot()["ok"] == 0


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({}, "needs api_key (usually dg.EnvVar('AZURE_OPENAI_API_KEY')) or token_provider"),
        (
            {"api_key": "k", "token_provider": "helpers.azure_token:token"},
            "set exactly one",
        ),
        ({"api_key": "k", "token_provider": "helpers.azure_token:nothing"}, "set exactly one"),
        ({"token_provider": "helpers.azure_token:nothing"}, "names no function"),
        ({"api_key": "k", "azure_endpoint": None}, "needs azure_endpoint"),
    ],
)
def test_a_missing_or_doubled_setting_is_a_clear_error(
    settings: dict[str, Any], said: str, tmp_path: Any
) -> None:
    result = run(resource("http://127.0.0.1:9", **settings), tmp_path)
    assert not result.success
    assert said in step_error(result)


def test_openai_paths_are_taken_and_others_refused() -> None:
    azure = resource("http://127.0.0.1:9", api_key="k")
    assert azure._path("/v1/chat/completions") == azure._path("/chat/completions")
    with pytest.raises(ValueError, match="deployments take /chat/completions, /embeddings"):
        azure._path("/v1/responses")
