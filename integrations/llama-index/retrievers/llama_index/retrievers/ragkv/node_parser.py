"""``RagkvNodeParser``: LlamaIndex nodes that are exactly ragkv's stored chunks.

A LlamaIndex index built with its own splitter (``SentenceSplitter``: sentence-aligned windows with
overlap) cuts a long document elsewhere than ragkv does, so a retrieved node holds parts of stored
chunks: the parts under half a chunk are not found in the query engine's prompt and are computed
(91-99% of a node's tokens from stored KV on 2,000-3,000-token documents, docs/BENCHMARKS.md).
With this parser the index's nodes are ragkv's chunks (the same tokenizer, ``chunk_tokens`` and
overlap, the same text), so every node in LlamaIndex's prompt is a stored chunk::

    index = VectorStoreIndex.from_documents(docs, transformations=[RagkvNodeParser(rag=rag)], ...)
    index.as_query_engine(llm=RagkvLlamaLLM(rag=rag)).query(q)   # all of the context from stored KV

Documents ragkv already holds (the same text) are not ingested again; others are ingested on first
use as the wrappers ingest foreign documents (``ext-<sha256>``, idempotent). Each node carries the
document's metadata and ragkv's ids (``ragkv_chunk_id``, ``ragkv_kv_key``...; kept out of the prompt
and the embedding), so ``RagkvLlamaLLM.complete(q, chunks=nodes)`` uses the chunks directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.node_parser import NodeParser
from llama_index.core.node_parser.node_utils import build_nodes_from_splits
from llama_index.core.schema import BaseNode
from pydantic import Field

from ragkv_frameworks import RagkvRunner, ragkv_metadata


class RagkvNodeParser(NodeParser):
    """Split documents into the chunks ragkv stores for them (see the module docstring)."""

    rag: Any = Field(exclude=True, description="the ragkv.rag.RAG whose chunks the nodes are")
    collection: str | None = Field(None, description="whose chunks (None: the default collection)")

    @classmethod
    def class_name(cls) -> str:
        return "RagkvNodeParser"

    def _parse_nodes(self, nodes: Sequence[BaseNode], show_progress: bool = False, **kwargs: Any) -> list:
        groups, _ = RagkvRunner(self.rag, self.collection).resolve_each(list(nodes))
        out = []
        for node, recs in zip(nodes, groups, strict=True):
            built = build_nodes_from_splits([r.text for r in recs], node, id_func=self.id_func)
            for n, rec in zip(built, recs, strict=True):
                ids = ragkv_metadata(rec)
                n.metadata.update(ids)
                # new lists: build_nodes_from_splits shares the document's own
                n.excluded_llm_metadata_keys = [*n.excluded_llm_metadata_keys, *ids]
                n.excluded_embed_metadata_keys = [*n.excluded_embed_metadata_keys, *ids]
            out.extend(built)
        return out
