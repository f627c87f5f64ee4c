"""Retriever-aware KV layer: ingest (split, embed, index, precompute KV), retrieve, answer."""

from ragkv.prompt import DEFAULT_INSTRUCTION, DEFAULT_QUESTION, PROMPT_KEYS, prompt_options, prompt_parts
from ragkv.rag.embedder import DEFAULT_EMBEDDER, Embedder
from ragkv.rag.generation import (
    EngineGenerator,
    Generated,
    Generator,
    OptionNotServedError,
    PromptJob,
    ThreadGenerator,
)
from ragkv.rag.index import ChunkIndex, ChunkRecord, IndexFullError
from ragkv.rag.pipeline import (
    RAG,
    Document,
    IngestCancelled,
    IngestReport,
    RagAnswer,
    RagPrompt,
    WarnThrottle,
)
from ragkv.rag.quotas import QuotaExceededError, Quotas, Usage
from ragkv.rag.splitter import TextChunk, split_tokens

__all__ = [
    "DEFAULT_EMBEDDER",
    "DEFAULT_INSTRUCTION",
    "DEFAULT_QUESTION",
    "RAG",
    "ChunkIndex",
    "ChunkRecord",
    "Document",
    "Embedder",
    "EngineGenerator",
    "Generated",
    "Generator",
    "IndexFullError",
    "OptionNotServedError",
    "PromptJob",
    "ThreadGenerator",
    "IngestCancelled",
    "QuotaExceededError",
    "Quotas",
    "Usage",
    "IngestReport",
    "RagAnswer",
    "RagPrompt",
    "TextChunk",
    "WarnThrottle",
    "PROMPT_KEYS",
    "prompt_options",
    "prompt_parts",
    "split_tokens",
]
