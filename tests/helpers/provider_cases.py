"""The providers the contract suite runs against: one :class:`ProviderCase` each, in ``CASES``.

Every provider behind ``provider_batch_asset`` gives the same guarantees, and one suite checks
them all (``tests/integration/test_provider_contract.py``, ``tests/reliability/
test_provider_kills.py``), the way fsspec runs one suite against every filesystem. A case says
what differs: how to start the provider's fake API on 127.0.0.1 and what it counted, the Dagster
resource on it, how an answer is read, how a failed request's ``_error`` starts, its prices.

A fake (:class:`Fake`) serves the provider's batch API and its online endpoint on the same
address, as the provider does, and counts what it was asked on its own side: batches created,
requests submitted and processed (paid), and requests processed per ``custom_id``, so a test can
hold "no request paid twice" with the provider's count, not ours. It moves its batches by the
common knobs of ``examples.llm_batch.jobs.Settings`` (``processing_delay``, ``error_rate``,
``expire_rate``, ``expire_after``, ``seed``) and by the clock it is given.

The suite expects what the local provider's batches do (``examples/llm_batch/jobs.py``): a
fake built on its ``Job`` and ``Answerer`` behaves so. Answers classify the three ticket texts
as ``billing``, ``technical``, ``other``, with a token per word; a batch that expires ends with
the first half of its requests done; which batch expires is ``jobs.expires(settings, draws, n)``
for the fake's n-th batch; a request fails with HTTP 500 at ``error_rate``, drawn per
``custom_id`` and attempt; results come back in another order than the input.

To add a provider: write its fake (a module of ``examples/``), a function that starts it and
yields a :class:`Fake`, and a ``ProviderCase``; add the case to ``CASES`` (one line).
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from checkpoint_assets import (
    AnthropicResource,
    AzureOpenAIResource,
    BedrockResource,
    GeminiResource,
    OpenAIResource,
    Price,
)
from checkpoint_assets.engine.providers.submissions import BatchProvider
from examples import serving
from examples.llm_batch import azure_api, compatible_api
from examples.llm_batch.jobs import Settings
from examples.llm_batch.online import Both
from examples.llm_batch.provider import Provider
from examples.llm_openai.server import ChatServer
from examples.llm_openai.server import Settings as ChatSettings

#: The counts every fake's ``counts()`` holds (more are allowed): batches created and cancels
#: asked; requests submitted in batches created, processed (paid: succeeded + errored), left
#: unrun by an expiry or a cancel; the tokens of the successes.
COUNTS = (
    "creates",
    "cancels",
    "submitted",
    "processed",
    "succeeded",
    "errored",
    "expired",
    "cancelled",
    "input_tokens",
    "output_tokens",
)


@dataclass(frozen=True)
class Fake:
    """A provider's fake API, running.

    ``urls`` is all a resource needs to reach it (plain strings: a kill test hands them to its
    child process as JSON). ``counts()`` are its batch API's counts (``COUNTS``);
    ``processed()`` its batch requests processed, per ``custom_id``; ``online()`` the online
    requests it answered (paid).
    """

    urls: Mapping[str, str]
    counts: Callable[[], Mapping[str, int]]
    processed: Callable[[], Counter[str]]
    online: Callable[[], int]

    def paid(self) -> int:
        """Requests paid for: processed in batches, and answered online."""
        return self.counts()["processed"] + self.online()


def chat(text: str) -> dict[str, Any]:
    """The request of ``text`` in the messages of OpenAI's and Anthropic's APIs."""
    return {"messages": [{"role": "user", "content": text}]}


def _batch_provider(resource: Any) -> BatchProvider:
    api: BatchProvider = resource.batch_provider()
    return api


@dataclass(frozen=True)
class ProviderCase:
    """What differs between providers, for the contract suite.

    Attributes:
        name: the test id (``openai``, ``anthropic``, ``azure_openai``, ...).
        key: the resource key the asset names (``provider=``).
        start: starts the fake with these settings and clock (``time.time`` or a
            ``ManualClock``); yields it, stops it when the block exits.
        resource: the Dagster resource on the fake's ``urls``. Its credentials are given by
            reference (``dg.EnvVar``, a profile...) to the environment variables of ``secrets``,
            which the suite sets before it builds the resource.
        request: a prompt -> the provider's request body of it (the ``request`` of the asset).
        parse: a response body -> ``answer``, ``input_tokens``, ``output_tokens``.
        error: how the ``_error`` of a request the provider failed (HTTP 500) starts.
        invalid: a request body the provider refuses as invalid (its ``_error`` is no
            transient error: not sent again).
        price: the provider's price (its batch discount) for the dry-run estimate and the cost.
        secrets: environment variable -> the secret value the suite sets it to (never to show
            in a log).
        adapter: the resource's batch adapter as a kill test's child runs it, the resource
            initialized (default: ``resource.batch_provider()``).
        draws: the API name its fake draws which batches expire by (``jobs.expires``);
            empty: ``name``.
    """

    name: str
    key: str
    start: Callable[[Settings, Callable[[], float]], AbstractContextManager[Fake]]
    resource: Callable[[Mapping[str, str]], dg.ConfigurableResource]
    parse: Callable[[dict[str, Any]], dict[str, Any]]
    error: str
    request: Callable[[str], dict[str, Any]] = chat
    invalid: Mapping[str, Any] = field(default_factory=lambda: {"messages": []})
    price: Price = field(default_factory=lambda: Price(input=1.0, output=2.0))
    secrets: Mapping[str, str] = field(default_factory=dict)
    adapter: Callable[[Any], BatchProvider] = _batch_provider
    draws: str = ""


# -- the OpenAI and Anthropic fakes (examples/llm_batch) ------------------------------------------
@contextmanager
def both(
    settings: Settings, clock: Callable[[], float], chat: ChatSettings | None = None
) -> Iterator[tuple[str, Both]]:
    """The local batch provider and chat server on one base URL (``examples/llm_batch/online.py``),
    moving its batches by ``clock``; yields the OpenAI base URL (``/v1``) and the application."""
    app = Both(Provider(settings, clock), ChatServer(chat or ChatSettings()))
    with serving.in_thread(app, "provider and chat server") as url:
        yield url, app


def processed_by_custom_id(provider: Provider) -> Counter[str]:
    """The requests the local batch provider processed, per ``custom_id`` (both APIs)."""
    provider.ledger.settle_all()
    jobs = [*provider.ledger.batches.values(), *provider.ledger.message_batches.values()]
    return Counter(outcome.custom_id for job in jobs for outcome in job.outcomes)


def fake_of(app: Both, urls: Mapping[str, str]) -> Fake:
    return Fake(
        urls=urls,
        counts=app.provider.snapshot,
        processed=lambda: processed_by_custom_id(app.provider),
        online=lambda: app.chat.snapshot()["ok"],
    )


@contextmanager
def start_local(settings: Settings, clock: Callable[[], float]) -> Iterator[Fake]:
    """OpenAI's and Anthropic's fake: ``urls["base_url"]`` is OpenAI's (``/v1``)."""
    with both(settings, clock) as (url, app):
        yield fake_of(app, {"base_url": url})


def openai_parse(body: dict[str, Any]) -> dict[str, Any]:
    usage = body["usage"]
    return {
        "answer": body["choices"][0]["message"]["content"],
        "input_tokens": usage["prompt_tokens"],
        "output_tokens": usage["completion_tokens"],
    }


def anthropic_parse(message: dict[str, Any]) -> dict[str, Any]:
    usage = message["usage"]
    return {
        "answer": message["content"][0]["text"],
        "input_tokens": usage["input_tokens"],
        "output_tokens": usage["output_tokens"],
    }


def _anthropic_adapter(resource: AnthropicResource) -> BatchProvider:
    api = resource.batch_provider()
    api.find_poll_seconds = 0.1  # find polls the batch a kill left unrecorded: poll it often
    return api


OPENAI = ProviderCase(
    name="openai",
    key="openai",
    start=start_local,
    resource=lambda urls: OpenAIResource(
        base_url=urls["base_url"], api_key=dg.EnvVar("OPENAI_API_KEY"), model="m", max_tokens=8
    ),
    parse=openai_parse,
    error="HTTP 500",
    secrets={"OPENAI_API_KEY": "sk-contract-openai-5ecret"},
)
ANTHROPIC = ProviderCase(
    name="anthropic",
    key="claude",
    start=start_local,
    resource=lambda urls: AnthropicResource(
        base_url=urls["base_url"].removesuffix("/v1"),
        api_key=dg.EnvVar("ANTHROPIC_API_KEY"),
        model="claude-test",
        max_tokens=8,
    ),
    parse=anthropic_parse,
    error="api_error: ",
    secrets={"ANTHROPIC_API_KEY": "sk-ant-contract-5ecret"},
    adapter=_anthropic_adapter,
)


@contextmanager
def start_azure(settings: Settings, clock: Callable[[], float]) -> Iterator[Fake]:
    """Azure OpenAI's fake (``examples/llm_batch/azure_api.py``) before the local provider and
    chat server: ``urls["azure_endpoint"]``."""
    with azure_api.serve(settings, clock=clock) as (endpoint, app):
        yield fake_of(app, {"azure_endpoint": endpoint})


AZURE_OPENAI = ProviderCase(
    name="azure_openai",
    key="azure_openai",
    start=start_azure,
    resource=lambda urls: AzureOpenAIResource(
        azure_endpoint=urls["azure_endpoint"],
        api_key=dg.EnvVar("AZURE_OPENAI_API_KEY"),
        deployment="gpt-4o-mini",
        batch_deployment="gpt-4o-mini-batch",
        model="gpt-4o-mini",
        max_tokens=8,
    ),
    parse=openai_parse,
    error="HTTP 500",
    secrets={"AZURE_OPENAI_API_KEY": azure_api.KEY},
    draws="openai",  # its batches are the local provider's OpenAI batches
)


@contextmanager
def start_compatible(settings: Settings, clock: Callable[[], float]) -> Iterator[Fake]:
    """An OpenAI-compatible batch API that drops batch metadata and takes a 7-day window
    (``examples/llm_batch/compatible_api.py``): ``urls["base_url"]``."""
    compatibility = compatible_api.Compatibility(windows=("24h", "7d"), metadata="drop")
    with compatible_api.serve(compatibility, settings, clock=clock) as (url, app):
        yield fake_of(app, {"base_url": url})


OPENAI_COMPATIBLE = ProviderCase(
    name="openai_compatible",
    key="compatible",
    start=start_compatible,
    resource=lambda urls: OpenAIResource(
        base_url=urls["base_url"],
        api_key=dg.EnvVar("COMPATIBLE_API_KEY"),
        model="m",
        max_tokens=8,
        batch_completion_window="7d",
        batch_metadata=False,  # found again by the input file's name
    ),
    parse=openai_parse,
    error="HTTP 500",
    secrets={"COMPATIBLE_API_KEY": "sk-contract-compatible-5ecret"},
    draws="openai",
)


# -- Amazon Bedrock's fake (helpers/bedrock_fake.py), over S3 on moto's server -------------------
@contextmanager
def start_bedrock(settings: Settings, clock: Callable[[], float]) -> Iterator[Fake]:
    """Bedrock's fake and an S3 server of its own with a bucket. Its minimum records per job is
    1, so that the suite's small tables run as jobs (the minimum is test_bedrock.py's)."""
    import boto3

    from helpers.bedrock_fake import moto_s3, serve

    with moto_s3() as s3, serve(s3, settings, clock, min_records=1) as fake:
        bucket = "contract-bedrock"
        keys = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
        client = boto3.client("s3", endpoint_url=s3, region_name="us-east-1", **keys)
        client.create_bucket(Bucket=bucket)
        yield Fake(
            urls={"bedrock": fake.url, "s3": s3, "bucket": bucket},
            counts=fake.snapshot,
            processed=fake.processed,
            online=lambda: sum(fake.online.values()),
        )


BEDROCK = ProviderCase(
    name="bedrock",
    key="bedrock",
    start=start_bedrock,
    # Credentials by reference: boto3's chain reads them from the environment (``secrets``).
    resource=lambda urls: BedrockResource(
        region="us-east-1",
        model_id="anthropic.claude-3-5-haiku-20241022-v1:0",
        max_tokens=8,
        batch_role_arn="arn:aws:iam::123456789012:role/bedrock-batch",
        input_prefix=f"s3://{urls['bucket']}/input/",
        output_prefix=f"s3://{urls['bucket']}/output/",
        endpoint_urls={"bedrock": urls["bedrock"], "bedrock-runtime": urls["bedrock"]}
        | {"s3": urls["s3"]},
        min_records_per_job=1,
    ),
    parse=anthropic_parse,
    error="Bedrock error 500",
    secrets={
        "AWS_ACCESS_KEY_ID": "AKIACONTRACTBEDROCK7",
        "AWS_SECRET_ACCESS_KEY": "bedrock-contract-5ecret",
    },
)


# -- Gemini: the Gemini API's Batch Mode and Vertex AI's batch prediction (helpers/gemini_fake.py)
@contextmanager
def start_gemini(settings: Settings, clock: Callable[[], float]) -> Iterator[Fake]:
    """The Gemini API's fake: ``urls["base_url"]`` (no path)."""
    from helpers.gemini_fake import serve

    with serve(settings, clock) as (url, fake):
        yield Fake({"base_url": url}, fake.snapshot, fake.processed, fake.online)


@contextmanager
def start_vertex(settings: Settings, clock: Callable[[], float]) -> Iterator[Fake]:
    """Vertex AI's fake, its batch files in a new bucket of fake-gcs-server; the service
    account key file that ``GOOGLE_APPLICATION_CREDENTIALS`` names is written for its tokens."""
    from helpers.gemini_fake import gcs, serve, service_account_file

    storage, options = gcs().new_storage()
    with serve(settings, clock, storage_options=options) as (url, fake):
        service_account_file(os.environ["GOOGLE_APPLICATION_CREDENTIALS"], url)
        urls = {
            "base_url": url,
            "gcs_endpoint": options["endpoint_url"],
            "gcs_prefix": storage.replace("/checkpoints", "/batches"),
        }
        yield Fake(urls, fake.snapshot, fake.processed, fake.online)


def gemini_request(text: str) -> dict[str, Any]:
    return {"contents": [{"role": "user", "parts": [{"text": text}]}]}


def gemini_parse(body: dict[str, Any]) -> dict[str, Any]:
    usage = body["usageMetadata"]
    return {
        "answer": body["candidates"][0]["content"]["parts"][0]["text"],
        "input_tokens": usage["promptTokenCount"],
        "output_tokens": usage["candidatesTokenCount"],
    }


GEMINI = ProviderCase(
    name="gemini",
    key="gemini",
    start=start_gemini,
    resource=lambda urls: GeminiResource(
        base_url=urls["base_url"],
        api_key=dg.EnvVar("GEMINI_API_KEY"),
        model="gemini-test",
        max_output_tokens=8,
        inline_max_bytes=100_000,  # a 300-row shard inline, a 2,000-row one as a file
    ),
    parse=gemini_parse,
    error="INTERNAL: ",
    request=gemini_request,
    invalid={"contents": [{"role": "user", "parts": []}]},
    secrets={"GEMINI_API_KEY": "AIza-contract-gemini-5ecret"},
)
VERTEX = ProviderCase(
    name="vertex",
    key="gemini",
    start=start_vertex,
    resource=lambda urls: GeminiResource(
        vertexai=True,
        project="test-project",
        location="us-central1",
        base_url=urls["base_url"],
        gcs_prefix=urls["gcs_prefix"],
        storage_options={"endpoint_url": urls["gcs_endpoint"], "token": "anon"},
        model="gemini-test",
        max_output_tokens=8,
    ),
    parse=gemini_parse,
    error="INTERNAL: ",
    request=gemini_request,
    invalid={"contents": [{"role": "user", "parts": []}]},
    # Application default credentials: the key file of a service account (its path is all the
    # environment holds; the fake's start writes the file).
    secrets={
        "GOOGLE_APPLICATION_CREDENTIALS": os.path.join(
            tempfile.gettempdir(), f"checkpoint-assets-vertex-key-{os.getpid()}.json"
        )
    },
)

#: Every provider the contract suite runs against; a provider adds its case on a line of its own.
CASES: list[ProviderCase] = [
    OPENAI,
    ANTHROPIC,
    AZURE_OPENAI,
    OPENAI_COMPATIBLE,
    BEDROCK,
    GEMINI,
    VERTEX,
]
BY_NAME: dict[str, ProviderCase] = {case.name: case for case in CASES}
