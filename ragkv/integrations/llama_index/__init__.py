"""LlamaIndex integration: ragkv LLM (complete / stream / chat with chunk options), retriever, query engine.

::

    from ragkv.integrations.llama_index import RagkvLlamaLLM, RagkvLlamaRetriever, RagkvQueryEngine
    engine = RagkvQueryEngine(retriever=RagkvLlamaRetriever(rag, k=4), llm=RagkvLlamaLLM(rag=rag))
    resp = engine.query("Who wrote ...?")   # resp.metadata["ragkv"]["kv_hits"], resp.source_nodes

LlamaIndex's own ``VectorStoreIndex(...).as_query_engine(llm=RagkvLlamaLLM(rag=rag))`` works
unchanged: the stored chunks inside its flat prompt are found and given as themselves (the answer is
the explicit form's, their KV reused). ``RagkvNodeParser`` makes the index's nodes ragkv's chunks.
"""

from ragkv.integrations.common import CHUNK_SEPARATOR, format_docs
from ragkv.integrations.llama_index.embeddings import RagkvLlamaEmbedding
from ragkv.integrations.llama_index.llms import RagkvLlamaLLM
from ragkv.integrations.llama_index.node_parser import RagkvNodeParser
from ragkv.integrations.llama_index.query_engine import RagkvQueryEngine
from ragkv.integrations.llama_index.retrievers import RagkvLlamaRetriever, to_node

__all__ = [
    "CHUNK_SEPARATOR",
    "RagkvLlamaEmbedding",
    "RagkvLlamaLLM",
    "RagkvNodeParser",
    "RagkvLlamaRetriever",
    "RagkvQueryEngine",
    "format_docs",
    "to_node",
]
