"""LangChain's own standard test suite (``langchain-tests``) on ragkv's LangChain classes: the chat
model (plain, and answering over retrieved chunks), the retriever and the embeddings, with the tiny
trained model. Structured output (``with_structured_output``: ``json_schema`` and ``json_mode``, by
constrained decoding) runs the suite's tests; features ragkv does not have (tool calling, multimodal
input) are declared unsupported the suite's way, so those tests skip rather than fail."""

from __future__ import annotations

import functools
import shutil
import tempfile
from typing import Any

import pytest

pytest.importorskip("langchain_tests")

from langchain_tests.integration_tests import (  # noqa: E402
    ChatModelIntegrationTests,
    EmbeddingsIntegrationTests,
    RetrieversIntegrationTests,
)
from langchain_tests.unit_tests import ChatModelUnitTests, EmbeddingsUnitTests  # noqa: E402

from ragkv import LLM  # noqa: E402
from ragkv.integrations.langchain import ChatRagkv, RagkvEmbeddings, RagkvRetriever  # noqa: E402
from ragkv.rag import RAG, Embedder  # noqa: E402
from tests.helpers import musique_samples, stories_path  # noqa: E402


@functools.lru_cache(maxsize=1)
def shared_rag() -> RAG:
    """One RAG over a few MuSiQue passages for every class here (the suite builds models from params)."""
    data = tempfile.mkdtemp(prefix="ragkv-lc-std-")
    rag = RAG(LLM(str(stories_path())), data, embedder=Embedder(), chunk_tokens=64, top_k=3)
    docs = [
        {"id": f"s{i}-p{j}", "text": c["text"][:300]}
        for i, s in enumerate(musique_samples(2))
        for j, c in enumerate(s["ctxs"][:3])
    ]
    rag.ingest(docs, show_progress=False)
    rag._tmp = data  # removed by the module fixture below
    return rag


@pytest.fixture(scope="module", autouse=True)
def _close_shared_rag(one_thread):
    yield
    if shared_rag.cache_info().currsize:
        rag = shared_rag()
        rag.close()
        shutil.rmtree(rag._tmp, ignore_errors=True)
        shared_rag.cache_clear()


class _ChatParams:
    @property
    def chat_model_class(self) -> type[ChatRagkv]:
        return ChatRagkv

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"rag": shared_rag()}

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return True  # ChatRagkv.with_structured_output: constrained decoding, no tool calling

    @property
    def supports_json_mode(self) -> bool:
        return True


class TestChatRagkvUnit(_ChatParams, ChatModelUnitTests):
    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # the model runs in process (or on a vLLM server configured on the backend): it takes no API
        # key, and refuses one rather than ignore it (test_langchain_params: unknown arguments)
        return {k: v for k, v in super().standard_chat_model_params.items() if k != "api_key"}


class TestChatRagkvIntegration(_ChatParams, ChatModelIntegrationTests):
    pass


class TestChatRagkvRetrievingIntegration(_ChatParams, ChatModelIntegrationTests):
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


class _EmbeddingsParams:
    @property
    def embeddings_class(self) -> type[RagkvEmbeddings]:
        return RagkvEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {"embedder": shared_rag().embedder}


class TestRagkvEmbeddingsUnit(_EmbeddingsParams, EmbeddingsUnitTests):
    pass


class TestRagkvEmbeddingsIntegration(_EmbeddingsParams, EmbeddingsIntegrationTests):
    pass
