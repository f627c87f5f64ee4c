"""``RagkvRetriever`` over ragkv's chunk index, and ``RagkvEmbeddings`` (ragkv's embedder for other stores)."""

from __future__ import annotations

import asyncio
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever, LangSmithRetrieverParams
from pydantic import ConfigDict, Field

from ragkv.rag import ChunkRecord
from ragkv_frameworks import CHUNK_ID_PREFIX, chunk_metadata


def to_document(rec: ChunkRecord) -> Document:
    """A chunk as a LangChain Document: ``id="ragkv:<chunk id>"``, metadata with the chunk and KV keys."""
    return Document(
        id=f"{CHUNK_ID_PREFIX}{rec.chunk_id}", page_content=rec.text, metadata=chunk_metadata(rec)
    )


class RagkvRetriever(BaseRetriever):
    """Top-``k`` chunks of ragkv's index; hand them to a ragkv model with ``chunks=docs`` to reuse their KV.
    ``invoke(query, k=2)`` overrides ``k`` for one call."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    rag: Any = Field(exclude=True, description="the ragkv.rag.RAG whose index is searched")
    k: int | None = Field(None, ge=1, description="chunks per query (None: the RAG's top_k)")
    collection: str | None = Field(None, description="the collection searched (None: the default one)")

    def _k(self, k: int | None, kwargs: dict) -> int | None:
        unknown = set(kwargs) - {"verbose"}  # BaseRetriever passes its own ``verbose`` through
        if unknown:
            raise TypeError(f"unknown retriever options {sorted(unknown)}; use k")
        return self.k if k is None else k

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None, **kwargs: Any
    ) -> list[Document]:
        return [to_document(r) for r in self.rag.retrieve(query, self._k(k, kwargs), self.collection)]

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        k: int | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        recs = await asyncio.to_thread(self.rag.retrieve, query, self._k(k, kwargs), self.collection)
        return [to_document(r) for r in recs]

    def _get_ls_params(self, **kwargs: Any) -> LangSmithRetrieverParams:
        params = super()._get_ls_params(**kwargs)
        params["ls_embedding_provider"] = "ragkv"
        params["ls_embedding_model"] = str(
            getattr(getattr(self.rag, "embedder", None), "name", "") or "ragkv"
        )
        return params


class RagkvEmbeddings(Embeddings):
    """ragkv's sentence embedder (all-MiniLM-L6-v2 by default) as LangChain ``Embeddings``."""

    def __init__(self, embedder=None):
        from ragkv.rag import Embedder

        self.embedder = embedder if embedder is not None else Embedder()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.embed(list(texts)).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embedder.embed([text])[0].tolist()
