"""Fixtures of langchain-ragkv's tests: the core suite's (one torch thread, the embedder), importable from a checkout."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
if (
    str(REPO) not in sys.path
):  # the core suite's helpers (tests.helpers) and eval.harness live in the checkout
    sys.path.insert(0, str(REPO))

from langchain_ragkv_support import shared_rag  # noqa: E402

from tests.conftest import embedder, one_thread  # noqa: E402, F401  (fixtures, re-exported)


@pytest.fixture(scope="module", autouse=True)
def _close_shared_rag(one_thread):  # noqa: F811
    """Close the module's shared RAG (and its data folder) after the module."""
    yield
    if shared_rag.cache_info().currsize:
        rag = shared_rag()
        rag.close()
        shutil.rmtree(rag._tmp, ignore_errors=True)
        shared_rag.cache_clear()
