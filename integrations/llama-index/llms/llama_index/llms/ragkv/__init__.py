"""``llama-index-llms-ragkv``: a LlamaIndex LLM answered by ragkv with the chunks' stored KV reused.

::

    from llama_index.llms.ragkv import RagkvLlamaLLM
    llm = RagkvLlamaLLM(rag=rag)
    llm.complete("Who wrote ...?", chunks=nodes)          # explicit chunks: their KV reused
    VectorStoreIndex(nodes).as_query_engine(llm=llm)       # LlamaIndex's own flat prompt works too

In LlamaIndex's own flat prompt the stored chunks are found and given as themselves (the answer is
the explicit form's, their KV reused). The retriever, query engine, embedding and node parser are
``llama-index-retrievers-ragkv`` (``llama_index.retrievers.ragkv``).
"""

from llama_index.llms.ragkv.base import RagkvLlamaLLM

from ragkv_frameworks import CHUNK_SEPARATOR, format_docs

__all__ = ["CHUNK_SEPARATOR", "RagkvLlamaLLM", "format_docs"]
