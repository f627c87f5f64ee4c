"""LangChain's standard unit tests (``langchain-tests``) on ragkv's chat model and embeddings."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langchain_tests")

from langchain_ragkv_support import ChatParams, EmbeddingsParams  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests, EmbeddingsUnitTests  # noqa: E402


class TestChatRagkvUnit(ChatParams, ChatModelUnitTests):
    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # the model runs in process (or on a vLLM server configured on the backend): it takes no API
        # key, and refuses one rather than ignore it (test_langchain_params: unknown arguments)
        return {k: v for k, v in super().standard_chat_model_params.items() if k != "api_key"}


class TestRagkvEmbeddingsUnit(EmbeddingsParams, EmbeddingsUnitTests):
    pass
