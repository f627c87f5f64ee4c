"""``RagkvLlamaEmbedding``: ragkv's sentence embedder as a LlamaIndex embedding model (for other indexes)."""

from __future__ import annotations

import asyncio
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding
from pydantic import ConfigDict, Field


class RagkvLlamaEmbedding(BaseEmbedding):
    """ragkv's embedder (all-MiniLM-L6-v2 by default) for LlamaIndex indexes; pass ``embedder=`` to share one."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    embedder: Any = Field(None, exclude=True, description="a ragkv.rag.Embedder (None: the default one)")

    def __init__(self, embedder: Any = None, **kwargs: Any):
        from ragkv.rag import Embedder

        embedder = embedder if embedder is not None else Embedder()
        super().__init__(embedder=embedder, model_name=str(getattr(embedder, "name", "ragkv")), **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "ragkv_embedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self.embedder.embed([query])[0].tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self.embedder.embed([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.embed(list(texts)).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await asyncio.to_thread(self._get_query_embedding, query)
