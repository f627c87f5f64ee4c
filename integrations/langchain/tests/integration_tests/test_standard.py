"""LangChain's own standard integration tests (``langchain-tests``) on ragkv's LangChain classes: the chat
model (plain, and answering over retrieved chunks), the retriever and the embeddings, with the tiny
trained model. Structured output (``with_structured_output``: ``json_schema`` and ``json_mode``, by
constrained decoding) runs the suite's tests; features ragkv does not have (tool calling, multimodal
input) are declared unsupported the suite's way, so those tests skip rather than fail. The unit suites
are ../unit_tests/test_standard.py."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langchain_tests")

from langchain_ragkv_support import ChatParams, EmbeddingsParams, shared_rag  # noqa: E402
from langchain_tests.integration_tests import (  # noqa: E402
    ChatModelIntegrationTests,
    EmbeddingsIntegrationTests,
    RetrieversIntegrationTests,
)

from langchain_ragkv import RagkvRetriever  # noqa: E402
from ragkv.testing import musique_samples  # noqa: E402


class TestChatRagkvIntegration(ChatParams, ChatModelIntegrationTests):
    pass


class TestChatRagkvRetrievingIntegration(ChatParams, ChatModelIntegrationTests):
    """The chat model answering every turn over chunks it retrieves from ragkv's index."""

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"rag": shared_rag(), "retrieve": True, "k": 2}


class TestRagkvRetrieverIntegration(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[RagkvRetriever]:
        return RagkvRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"rag": shared_rag()}

    @property
    def retriever_query_example(self) -> str:
        return musique_samples(1)[0]["question"]


class TestRagkvEmbeddingsIntegration(EmbeddingsParams, EmbeddingsIntegrationTests):
    pass
