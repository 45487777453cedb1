"""``BedrockResource``: Amazon Bedrock through ``boto3``, online and as batch inference jobs.

>>> from checkpoint_assets.resources.bedrock import BedrockResource
>>> claude = BedrockResource(
...     region="us-east-1", model_id="anthropic.claude-3-haiku-20240307-v1:0", max_tokens=64
... )
>>> claude.request_defaults()
{'anthropic_version': 'bedrock-2023-05-31', 'max_tokens': 64}
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Final

import dagster as dg
from pydantic import Field, field_validator

if TYPE_CHECKING:
    from checkpoint_assets.resources.bedrock_batches import BedrockBatches

__all__ = ["BedrockError", "BedrockResource"]

# Retries of the batch API's own requests (create, list, get, stop, S3) and of a small
# submission's online calls. The create is safe to repeat: its clientRequestToken is the tag.
_BATCH_API_RETRIES: Final = 5
# Model ids of the models whose native body this resource builds: Anthropic's Claude, by
# foundation model id ("anthropic.claude-...") or inference profile ("us.anthropic.claude-...").
_SUPPORTED: Final = "anthropic.claude"
# boto3's clients block: online requests run on threads of their own, as many as a client's
# pooled connections.
_THREADS: Final = 32
_CLIENTS: Final[dict[tuple[Any, ...], Any]] = {}
_EXECUTORS: Final[dict[int, ThreadPoolExecutor]] = {}  # by process
_LOCK: Final = threading.Lock()


class BedrockError(Exception):
    """An error status of Bedrock's runtime for one online request.

    ``status_code`` is the HTTP status: a 429 (``ThrottlingException``) or a 503 pauses the
    shard as a rate limit; any other is an ordinary failed call, retried as the asset's
    ``max_attempts`` says."""

    def __init__(self, code: str, status_code: int, message: str) -> None:
        super().__init__(f"Bedrock {code} (HTTP {status_code}): {message}")
        self.code = code
        self.status_code = status_code


class BedrockResource(dg.ConfigurableResource):
    """Amazon Bedrock, for ``provider_batch_asset``: batch inference jobs that read JSONL from S3
    and write results to S3, and InvokeModel online. Needs
    ``pip install "checkpoint-assets[bedrock]"``.

    It builds the native request body of Anthropic's Claude models (the Messages API with
    ``anthropic_version``), which Bedrock takes in batch jobs and online alike, so one ``parse``
    reads both. Other models' bodies differ, and this resource refuses them.

    Credentials are never settings: boto3's default chain finds them (environment, the
    ``profile_name`` profile, SSO, the instance's or task's role), and ``assume_role_arn`` names a
    role to take on top of them.

    Example::

        bedrock = BedrockResource(
            region="us-east-1",
            model_id="anthropic.claude-3-5-haiku-20241022-v1:0",
            batch_role_arn=dg.EnvVar("BEDROCK_BATCH_ROLE_ARN"),
            input_prefix="s3://my-bucket/bedrock/input/",
            output_prefix="s3://my-bucket/bedrock/output/",
        )
    """

    region: str = Field(description="The AWS Region of Bedrock and its batch jobs, as us-east-1.")
    model_id: str = Field(
        description="The Claude model's id or inference profile, as "
        "anthropic.claude-3-5-haiku-20241022-v1:0 or us.anthropic.claude-3-5-haiku-20241022-v1:0."
    )
    max_tokens: int = Field(
        default=1024,
        gt=0,
        description="Most tokens an answer may have, sent with every request "
        "(`request_defaults()`); Claude requires it.",
    )
    anthropic_version: str = Field(
        default="bedrock-2023-05-31",
        description="The Messages API version that Claude on Bedrock takes, sent with every "
        "request.",
    )
    batch_role_arn: str | None = Field(
        default=None,
        description="The service role Bedrock runs batch jobs as: it reads input_prefix and "
        "writes output_prefix. Needed for batches, not online.",
    )
    input_prefix: str | None = Field(
        default=None,
        description="s3://bucket/prefix/ where each submission's JSONL file is written. Needed "
        "for batches.",
    )
    output_prefix: str | None = Field(
        default=None,
        description="s3://bucket/prefix/ under which Bedrock writes each job's results. Needed "
        "for batches.",
    )
    profile_name: str | None = Field(
        default=None,
        description="The AWS profile to take credentials from; unset: boto3's default chain.",
    )
    assume_role_arn: str | None = Field(
        default=None,
        description="A role to assume with those credentials, renewed before it expires.",
    )
    endpoint_urls: dict[str, str] = Field(
        default_factory=dict,
        description="Endpoint URL by boto3 service name (bedrock, bedrock-runtime, s3, sts), "
        "for a VPC endpoint or a local server; unset: AWS's.",
    )
    timeout_seconds: float = Field(
        default=60.0, gt=0, description="Seconds before one request fails with a timeout."
    )
    max_retries: int = Field(
        default=0,
        ge=0,
        description="Retries of an online request inside boto3. Keep 0 so that throttling and "
        "errors reach the checkpointed asset, which pauses the shard on a throttle.",
    )
    job_timeout_hours: int = Field(
        default=24,
        ge=24,
        le=168,
        description="Hours a batch job may run before Bedrock ends it as expired (24 to 168).",
    )
    min_records_per_job: int = Field(
        default=100,
        ge=1,
        description="Bedrock's quota 'Minimum number of records per batch inference job'. A "
        "submission with fewer rows is sent online.",
    )
    max_records_per_job: int = Field(
        default=50_000,
        ge=1,
        description="The quotas 'Records per batch inference job' and 'Records per input file "
        "per batch inference job' (the smaller): a submission is one file and one job.",
    )
    max_job_bytes: int = Field(
        default=1_000_000_000,
        ge=1,
        description="The quotas 'Batch inference input file size' and 'Batch inference job "
        "size' (the smaller), in bytes.",
    )

    concurrent_jobs: int | None = Field(
        default=None,
        gt=0,
        description="Provider batches: the quota 'Sum of in-progress and submitted batch "
        "inference jobs' of `model_id` in this Region (Service Quotas). Shards keep no more "
        "jobs than this between them. Unset, a refusal for it makes the shard wait for room "
        "and submit again.",
    )

    @field_validator("model_id")
    @classmethod
    def _claude(cls, model_id: str) -> str:
        if _SUPPORTED not in model_id:
            raise ValueError(
                f"BedrockResource builds the request body of Anthropic's Claude models, and "
                f"{model_id!r} is not one: use a Claude model id or inference profile (one that "
                f"holds {_SUPPORTED!r}). Other Bedrock models take other bodies and are not "
                "supported."
            )
        return model_id

    def request_defaults(self) -> dict[str, Any]:
        """What every request body takes from this resource where it leaves it out:
        ``anthropic_version`` and ``max_tokens`` (the model is the job's, not the body's)."""
        return {"anthropic_version": self.anthropic_version, "max_tokens": self.max_tokens}

    def checkpoint_fingerprint(self) -> dict[str, Any]:
        """The settings that change the answers: the API, the model and the request settings.
        Never credentials, roles, buckets or endpoints."""
        return {"api": "bedrock", "model": self.model_id, **self.request_defaults()}

    def client(self, service: str, *, retries: int | None = None) -> Any:
        """This process's boto3 client of ``service`` (``bedrock``, ``bedrock-runtime``,
        ``s3``), with this resource's Region, credentials, endpoint and timeouts: made once,
        then shared by every thread."""
        tries = self.max_retries if retries is None else retries
        key = (
            os.getpid(),
            service,
            tries,
            self.region,
            self.profile_name,
            self.assume_role_arn,
            self.endpoint_urls.get(service),
            self.timeout_seconds,
        )
        with _LOCK:
            found = _CLIENTS.get(key)
            if found is None:
                found = _CLIENTS[key] = self._make(service, tries)
            return found

    def _make(self, service: str, retries: int) -> Any:
        boto3 = _boto3()
        from botocore.config import Config

        config = Config(
            region_name=self.region,
            connect_timeout=self.timeout_seconds,
            read_timeout=self.timeout_seconds,
            retries={"mode": "standard", "total_max_attempts": retries + 1},
            max_pool_connections=_THREADS,
        )
        session = self._session(boto3)
        return session.client(service, config=config, endpoint_url=self.endpoint_urls.get(service))

    def _session(self, boto3: Any) -> Any:
        """A boto3 session on the default chain or ``profile_name``; with ``assume_role_arn``,
        on that role's credentials, renewed by botocore before they expire."""
        base = boto3.Session(profile_name=self.profile_name, region_name=self.region)
        if self.assume_role_arn is None:
            return base
        import botocore.session
        from botocore.credentials import (
            AssumeRoleCredentialFetcher,
            DeferredRefreshableCredentials,
        )

        sts = self.endpoint_urls.get("sts")

        def create_client(name: str, **kwargs: Any) -> Any:
            return base.client(name, endpoint_url=sts, **kwargs)

        fetcher = AssumeRoleCredentialFetcher(
            client_creator=create_client,
            source_credentials=base.get_credentials(),
            role_arn=self.assume_role_arn,
            extra_args={"RoleSessionName": "checkpoint-assets"},
        )
        core = botocore.session.Session()
        core._credentials = DeferredRefreshableCredentials(  # botocore's documented recipe
            refresh_using=fetcher.fetch_credentials, method="assume-role"
        )
        return boto3.Session(botocore_session=core, region_name=self.region)

    def sender(self, endpoint: str | None = None) -> Callable[[Mapping[str, Any]], Awaitable[Any]]:
        """An ``async`` function that sends one request body to the model with InvokeModel and
        returns its response body as a dict: the online way of ``provider_batch_asset``.

        The body gets ``request_defaults()`` where it leaves them out, as in a batch job. An
        error status raises :class:`BedrockError` (a throttle pauses the shard)."""
        _endpoint(endpoint)
        defaults = self.request_defaults()
        runtime = self.client("bedrock-runtime")

        def invoke(body: Mapping[str, Any]) -> Any:
            try:
                answer = runtime.invoke_model(
                    modelId=self.model_id,
                    body=json.dumps({**defaults, **body}).encode(),
                    contentType="application/json",
                    accept="application/json",
                )
            except runtime.exceptions.ClientError as e:
                error = e.response.get("Error", {})
                status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
                code, message = error.get("Code", "error"), error.get("Message", "")
                raise BedrockError(code, status, message) from e
            return json.loads(answer["body"].read())

        async def send(body: Mapping[str, Any]) -> Any:
            return await asyncio.get_running_loop().run_in_executor(_threads(), invoke, body)

        return send

    def batch_provider(self, endpoint: str | None = None) -> BedrockBatches:
        """Bedrock's batch inference jobs for this model, for provider batches (see
        ``bedrock_batches.py``): every body gets ``request_defaults()`` where it leaves them
        out. Needs ``batch_role_arn``, ``input_prefix`` and ``output_prefix``."""
        from checkpoint_assets.resources.bedrock_batches import BedrockBatches, Quotas

        _endpoint(endpoint)
        missing = [
            name
            for name in ("batch_role_arn", "input_prefix", "output_prefix")
            if not getattr(self, name)
        ]
        if missing:
            raise ValueError(
                f"BedrockResource needs {', '.join(missing)} for batch jobs: the service role "
                "Bedrock runs them as, and the s3:// prefixes of their input and output. Set "
                "them, or run mode online."
            )
        for name in ("input_prefix", "output_prefix"):
            if not str(getattr(self, name)).startswith("s3://"):
                raise ValueError(
                    f"BedrockResource.{name} must be an s3:// URI, got {getattr(self, name)!r}"
                )
        quotas = Quotas(
            min_records=self.min_records_per_job,
            max_records_per_job=self.max_records_per_job,
            max_records_per_file=self.max_records_per_job,
            max_file_bytes=self.max_job_bytes,
            max_job_bytes=self.max_job_bytes,
        )
        retries = _BATCH_API_RETRIES
        assert self.batch_role_arn and self.input_prefix and self.output_prefix
        return BedrockBatches(
            self.client("bedrock", retries=retries),
            self.client("bedrock-runtime", retries=retries),
            self.client("s3", retries=retries),
            model_id=self.model_id,
            role_arn=self.batch_role_arn,
            input_prefix=self.input_prefix,
            output_prefix=self.output_prefix,
            defaults=self.request_defaults(),
            quotas=quotas,
            timeout_hours=self.job_timeout_hours,
            concurrent_jobs=self.concurrent_jobs,
        )


def _threads() -> ThreadPoolExecutor:
    """This process's threads of online requests (a forked process makes its own)."""
    with _LOCK:
        found = _EXECUTORS.get(os.getpid())
        if found is None:
            found = _EXECUTORS[os.getpid()] = ThreadPoolExecutor(_THREADS, "bedrock")
        return found


def _endpoint(endpoint: str | None) -> None:
    if endpoint is not None:
        raise ValueError(
            f"BedrockResource sends the model's InvokeModel body only, not {endpoint!r}: leave "
            "the asset's endpoint unset."
        )


def _boto3() -> Any:
    try:
        import boto3
    except ModuleNotFoundError as e:
        if e.name != "boto3":
            raise
        raise ModuleNotFoundError(
            "BedrockResource needs the `boto3` package, which is not installed: pip install "
            '"checkpoint-assets[bedrock]"',
            name="boto3",
        ) from None
    return boto3
