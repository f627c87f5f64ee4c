"""``llama-index-retrievers-ragkv``: ragkv's chunk index on LlamaIndex's retrieval side.

::

    from llama_index.llms.ragkv import RagkvLlamaLLM
    from llama_index.retrievers.ragkv import RagkvLlamaRetriever, RagkvQueryEngine
    engine = RagkvQueryEngine(retriever=RagkvLlamaRetriever(rag, k=4), llm=RagkvLlamaLLM(rag=rag))
    resp = engine.query("Who wrote ...?")   # resp.metadata["ragkv"]["kv_hits"], resp.source_nodes

The retriever, the query engine that answers over its nodes with their KV reused, the embedding model
(ragkv's embedder, for other indexes) and ``RagkvNodeParser`` (an index's nodes made ragkv's chunks):
everything that turns documents into the chunks whose KV ragkv stores. The LLM is
``llama-index-llms-ragkv`` (``llama_index.llms.ragkv``).
"""

from llama_index.retrievers.ragkv.base import RagkvLlamaRetriever, to_node
from llama_index.retrievers.ragkv.embeddings import RagkvLlamaEmbedding
from llama_index.retrievers.ragkv.node_parser import RagkvNodeParser
from llama_index.retrievers.ragkv.query_engine import RagkvQueryEngine

from ragkv_frameworks import CHUNK_SEPARATOR, format_docs

__all__ = [
    "CHUNK_SEPARATOR",
    "RagkvLlamaEmbedding",
    "RagkvLlamaRetriever",
    "RagkvNodeParser",
    "RagkvQueryEngine",
    "format_docs",
    "to_node",
]
