"""The webserver's GraphQL API, as the UI calls it, for the end-to-end tests.

``DagsterGraphQLClient`` covers launching a job, terminating a run and reloading a code location;
the UI's partition backfill and re-execution have no client method, so they are posted here as
the UI posts them.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from typing import Any

from dagster_graphql import DagsterGraphQLClient

LAUNCH_BACKFILL = """
mutation($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message }
  }
}
"""

REEXECUTE = """
mutation($params: ReexecutionParams!) {
  launchRunReexecution(reexecutionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
  }
}
"""


def graphql(port: int, query: str, variables: dict[str, Any] | None = None) -> Any:
    """POST ``query`` to the webserver on 127.0.0.1:``port``; returns the decoded answer."""
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def client(port: int) -> DagsterGraphQLClient:
    return DagsterGraphQLClient("127.0.0.1", port_number=port)


def launch_backfill(
    port: int, partitions: Sequence[str], asset: str, tags: dict[str, str] | None = None
) -> str:
    """Backfill ``partitions`` of ``asset`` as the UI's "Materialize" dialog does; returns the
    backfill id (its runs carry the tag ``dagster/backfill``)."""
    params: dict[str, Any] = {
        "partitionNames": list(partitions),
        "assetSelection": [{"path": [asset]}],
    }
    if tags:
        params["tags"] = [{"key": k, "value": v} for k, v in tags.items()]
    answer = graphql(port, LAUNCH_BACKFILL, {"params": params})
    launched = answer["data"]["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    return str(launched["backfillId"])


def reexecute(port: int, run_id: str) -> str:
    """Re-execute a run with every step, as the UI's "Re-execute all" does; returns the new
    run's id."""
    params = {"parentRunId": run_id, "strategy": "ALL_STEPS"}
    answer = graphql(port, REEXECUTE, {"params": params})
    launched = answer["data"]["launchRunReexecution"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    return str(launched["run"]["runId"])
