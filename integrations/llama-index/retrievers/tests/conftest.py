"""Fixtures of llama-index-retrievers-ragkv's tests: ragkv.testing's (one torch thread, the embedder)."""

from __future__ import annotations

from ragkv.testing.fixtures import (  # noqa: F401  (fixtures, re-exported)
    embedder,
    one_thread,
    samples,
    tiny_rag,
)
