"""A Microsoft Entra ID token provider for ``AzureOpenAIResource(token_provider=...)`` in tests:
the token the fake Azure OpenAI (``examples/llm_batch/azure_api.py``) accepts."""

from examples.llm_batch.azure_api import TOKEN

CALLS: list[int] = []


def token() -> str:
    CALLS.append(1)
    return TOKEN
