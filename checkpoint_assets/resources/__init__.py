"""Dagster resources that hand a checkpointed function a model endpoint's client.

- :class:`OpenAIResource` uses the ``openai`` package: the OpenAI API and every server that
  speaks its protocol.
- :class:`AzureOpenAIResource` uses the ``openai`` package's Azure clients: OpenAI's models
  deployed on Azure OpenAI.
- :class:`AnthropicResource` uses the ``anthropic`` package.
- :class:`~checkpoint_assets.resources.bedrock.BedrockResource` (``bedrock.py``) uses ``boto3``:
  Claude on Amazon Bedrock, online and as batch inference jobs.
- :class:`GeminiResource` uses the ``google-genai`` package: the Gemini API and Vertex AI.

Each gives an ``async def`` function the client of its event loop. The client is made with
``max_retries=0``, so rate limits and errors reach the checkpointed asset. Each resource says
which of its settings change results (``checkpoint_fingerprint``). The packages are optional
extras, imported on first use.
"""

from checkpoint_assets.resources.anthropic import AnthropicResource
from checkpoint_assets.resources.azure_openai import AzureOpenAIResource
from checkpoint_assets.resources.gemini import GeminiResource
from checkpoint_assets.resources.openai import OpenAIResource

__all__ = ["AnthropicResource", "AzureOpenAIResource", "GeminiResource", "OpenAIResource"]
