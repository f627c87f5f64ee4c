"""Fixtures of langchain-ragkv's tests: ragkv.testing's (one torch thread, the embedder), and the shared
RAG closed after each module."""

from __future__ import annotations

import shutil

import pytest
from langchain_ragkv_support import shared_rag

from ragkv.testing.fixtures import (  # noqa: F401  (fixtures, re-exported)
    embedder,
    one_thread,
    samples,
    tiny_rag,
)


@pytest.fixture(scope="module", autouse=True)
def _close_shared_rag(one_thread):  # noqa: F811
    """Close the module's shared RAG (and its data folder) after the module."""
    yield
    if shared_rag.cache_info().currsize:
        rag = shared_rag()
        rag.close()
        shutil.rmtree(rag._tmp, ignore_errors=True)
        shared_rag.cache_clear()
