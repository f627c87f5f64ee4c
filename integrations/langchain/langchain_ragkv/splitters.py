"""``RagkvTextSplitter``: LangChain documents that are exactly ragkv's stored chunks.

A LangChain splitter (``RecursiveCharacterTextSplitter``...) cuts documents elsewhere than ragkv does,
so a retrieved piece holds parts of stored chunks and the parts under half a chunk are computed in
the chain's prompt. Splitting with this transformer makes the vector store's documents ragkv's chunks
(same tokenizer, ``chunk_tokens`` and overlap, same text), so a standard LCEL chain's ``"\\n\\n".join(
d.page_content ...)`` context comes from stored KV whole::

    splits = RagkvTextSplitter(rag).split_documents(docs)
    store = InMemoryVectorStore.from_documents(splits, RagkvEmbeddings(rag.embedder))

Documents ragkv already holds (the same text) are not ingested again; others are ingested on first
use as the wrappers ingest foreign documents (``ext-<sha256>``, idempotent). Each piece keeps its
document's metadata plus ragkv's ids (``ragkv_chunk_id``...), so ``chunks=docs`` uses them directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from langchain_core.documents import BaseDocumentTransformer, Document

from ragkv_frameworks import CHUNK_ID_PREFIX, RagkvRunner, check_backend, ragkv_metadata


class RagkvTextSplitter(BaseDocumentTransformer):
    """Split documents into the chunks ragkv stores for them (see the module docstring)."""

    def __init__(self, rag: Any, collection: str | None = None):
        self.rag = check_backend(rag)
        self.collection = collection  # whose chunks (None: the default collection); new text goes there

    def split_documents(self, documents: Iterable[Document]) -> list[Document]:
        docs = list(documents)
        groups, _ = RagkvRunner(self.rag, self.collection).resolve_each(docs)
        return [
            Document(
                id=f"{CHUNK_ID_PREFIX}{rec.chunk_id}",
                page_content=rec.text,
                metadata={**(doc.metadata or {}), **ragkv_metadata(rec)},
            )
            for doc, recs in zip(docs, groups, strict=True)
            for rec in recs
        ]

    def split_text(self, text: str) -> list[str]:
        """The texts of the chunks ragkv stores for ``text`` (ingested on first use)."""
        return [d.page_content for d in self.split_documents([Document(page_content=text)])]

    def create_documents(
        self, texts: Sequence[str], metadatas: Sequence[dict] | None = None
    ) -> list[Document]:
        """Documents of ``texts`` (with ``metadatas``), split into ragkv's chunks."""
        metas = list(metadatas) if metadatas is not None else [{}] * len(texts)
        return self.split_documents(
            Document(page_content=t, metadata=dict(m)) for t, m in zip(texts, metas, strict=True)
        )

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        return self.split_documents(documents)
