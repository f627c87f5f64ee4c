"""LangChain integration: ragkv models (completion and chat), retriever, embeddings and a chunk-aware chain.

::

    from integrations.langchain import RagkvLLM, RagkvRetriever, rag_chain
    llm, retriever = RagkvLLM(rag=rag), RagkvRetriever(rag=rag, k=4)
    out = rag_chain(retriever, llm).invoke("Who wrote ...?")  # {"question", "docs", "answer"}
    llm.invoke("Who wrote ...?", chunks=out["docs"])          # the same, by hand

Standard prompt | llm chains work too: format the documents with :func:`format_docs` and the
model splits them back into chunks at :data:`CHUNK_SEPARATOR`.
"""

from integrations.common import CHUNK_SEPARATOR, format_docs, split_prompt
from integrations.langchain.chains import rag_chain
from integrations.langchain.chat_models import ChatRagkv
from integrations.langchain.llms import RagkvLLM
from integrations.langchain.retrievers import RagkvEmbeddings, RagkvRetriever, to_document
from integrations.langchain.splitters import RagkvTextSplitter

__all__ = [
    "CHUNK_SEPARATOR",
    "ChatRagkv",
    "RagkvEmbeddings",
    "RagkvLLM",
    "RagkvRetriever",
    "RagkvTextSplitter",
    "format_docs",
    "rag_chain",
    "split_prompt",
    "to_document",
]
