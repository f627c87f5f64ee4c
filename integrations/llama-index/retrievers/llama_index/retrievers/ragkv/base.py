"""``RagkvLlamaRetriever``: ragkv's chunk index as a LlamaIndex retriever of ``NodeWithScore``."""

from __future__ import annotations

from typing import Any

from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from ragkv.rag import ChunkRecord
from ragkv_frameworks import CHUNK_ID_PREFIX, chunk_metadata


def to_node(rec: ChunkRecord) -> NodeWithScore:
    """A chunk as a node: ``node_id="ragkv:<chunk id>"``, metadata with the chunk and KV keys (kept out
    of prompts and embeddings)."""
    meta = chunk_metadata(rec)
    node = TextNode(
        id_=f"{CHUNK_ID_PREFIX}{rec.chunk_id}",
        text=rec.text,
        metadata=meta,
        excluded_llm_metadata_keys=list(meta),
        excluded_embed_metadata_keys=list(meta),
    )
    return NodeWithScore(node=node, score=rec.score)


class RagkvLlamaRetriever(BaseRetriever):
    """Top-``k`` chunks of a ``ragkv.rag.RAG``'s index, of ``collection`` (None: the default one)."""

    def __init__(self, rag: Any, k: int | None = None, collection: str | None = None, **kwargs: Any):
        self.rag = rag
        self.k = k
        self.collection = collection
        super().__init__(**kwargs)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [to_node(r) for r in self.rag.retrieve(query_bundle.query_str, self.k, self.collection)]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        import asyncio

        recs = await asyncio.to_thread(self.rag.retrieve, query_bundle.query_str, self.k, self.collection)
        return [to_node(r) for r in recs]
