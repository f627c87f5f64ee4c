"""LangChain integration: ragkv models (completion and chat), retriever, embeddings and a chunk-aware chain.

::

    from langchain_ragkv import RagkvLLM, RagkvRetriever, rag_chain
    llm, retriever = RagkvLLM(rag=rag), RagkvRetriever(rag=rag, k=4)
    out = rag_chain(retriever, llm).invoke("Who wrote ...?")  # {"question", "docs", "answer"}
    llm.invoke("Who wrote ...?", chunks=out["docs"])          # the same, by hand

The standard LCEL chain works unchanged (``{"context": retriever | format_docs, "question":
RunnablePassthrough()} | prompt | chat | StrOutputParser()`` with LangChain's usual ``format_docs``):
the stored chunks inside the flat prompt are found and given as themselves, so the answer is the
explicit form's and their KV is reused. :class:`RagkvTextSplitter` makes a vector store's documents
ragkv's own chunks (long documents). This module's :func:`format_docs` marks chunk boundaries with
:data:`CHUNK_SEPARATOR` instead, for text ragkv has not ingested.
"""

from langchain_ragkv.chains import rag_chain
from langchain_ragkv.chat_models import ChatRagkv
from langchain_ragkv.llms import RagkvLLM
from langchain_ragkv.retrievers import RagkvEmbeddings, RagkvRetriever, to_document
from langchain_ragkv.splitters import RagkvTextSplitter
from ragkv_frameworks import CHUNK_SEPARATOR, format_docs, split_prompt

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
