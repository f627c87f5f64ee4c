"""The interface of a RAG backend: what the framework wrappers and the HTTP service call.

A library-level protocol so that the edges (``integrations/``, ``apps/``) share it without depending
on each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from ragkv.generate import TokenEvent
from ragkv.rag.index import ChunkRecord
from ragkv.rag.pipeline import RagAnswer


@runtime_checkable
class RagBackend(Protocol):
    """What the wrappers and the app use of a RAG: ragkv's in-process :class:`ragkv.rag.RAG`, or a
    remote one (``integrations.vllm.client.VllmRAG``: retrieval here, generation on a vLLM server)."""

    mode: str
    ratio: float | str
    top_k: int

    @property
    def model(self) -> Any:
        """The served model's tokenizer and config (``encode``, ``tokenizer``, ``config``, ``fingerprint``)."""

    @property
    def index(self) -> Any:
        """The chunk index (``chunk``, ``chunks_of``, ``has_document``, ``document_ids``)."""

    @property
    def store(self) -> Any:
        """The chunk KV store."""

    def retrieve(self, question: str, k: int | None = None) -> list[ChunkRecord]: ...

    def prompt_parts(self, question: str) -> tuple[list[int], list[int]]:
        """Token ids of the prompt's head (system, instruction, few-shot turns) and tail (question)."""
        ...

    def chunks_by_id(self, chunk_ids: list[int]) -> list[ChunkRecord]: ...

    def fit_chunks(self, recs: list[ChunkRecord], other_tokens: int) -> list[ChunkRecord]: ...

    def ingest(self, docs: Any, show_progress: bool = True) -> Any: ...

    def answer(self, question: str, k=None, mode=None, ratio=None, params=None, chunks=None, **sampling): ...

    def answer_stream(
        self, question: str, k=None, mode=None, ratio=None, params=None, chunks=None, **sampling
    ) -> Iterator[TokenEvent | RagAnswer]: ...
