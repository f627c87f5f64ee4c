"""``RagkvQueryEngine``: retrieve with any LlamaIndex retriever, answer with the nodes' KV reused."""

from __future__ import annotations

from typing import Any

from llama_index.core.base.response.schema import Response
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.llms.ragkv import RagkvLlamaLLM
from pydantic import Field


class RagkvQueryEngine(CustomQueryEngine):
    """``query(q)``: ``retriever.retrieve(q)`` then ``llm.complete(q, chunks=nodes)``; nodes ragkv has
    never seen (another index's) are ingested on first use. ``response.metadata["ragkv"]`` has the
    reuse statistics."""

    retriever: Any = Field(description="a LlamaIndex BaseRetriever (RagkvLlamaRetriever or any other)")
    llm: RagkvLlamaLLM
    llm_kwargs: dict = Field(
        default_factory=dict, description="per-call options (mode, ratio, max_new_tokens)"
    )

    def custom_query(self, query_str: str) -> Response:
        nodes = self.retriever.retrieve(query_str)
        out = self.llm.complete(query_str, chunks=nodes, **self.llm_kwargs)
        return Response(out.text, source_nodes=nodes, metadata=dict(out.raw or {}))

    async def acustom_query(self, query_str: str) -> Response:
        nodes = await self.retriever.aretrieve(query_str)
        out = await self.llm.acomplete(query_str, chunks=nodes, **self.llm_kwargs)  # generates in a thread
        return Response(out.text, source_nodes=nodes, metadata=dict(out.raw or {}))
