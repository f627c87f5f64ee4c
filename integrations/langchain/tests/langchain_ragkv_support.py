"""What langchain-ragkv's unit and integration suites share: one RAG over a few MuSiQue passages, and the
parameters LangChain's standard chat-model and embeddings tests build ragkv's classes from."""

from __future__ import annotations

import functools
import tempfile
from typing import Any

from langchain_ragkv import ChatRagkv, RagkvEmbeddings
from ragkv import LLM
from ragkv.rag import RAG, Embedder
from ragkv.testing import musique_samples, stories_path


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
    rag._tmp = data  # removed by the conftest's module fixture
    return rag


class ChatParams:
    """The chat model's standard-suite parameters (unit and integration)."""

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


class EmbeddingsParams:
    """The embeddings' standard-suite parameters (unit and integration)."""

    @property
    def embeddings_class(self) -> type[RagkvEmbeddings]:
        return RagkvEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {"embedder": shared_rag().embedder}
