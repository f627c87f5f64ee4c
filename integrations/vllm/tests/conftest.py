"""Fixtures of ragkv-vllm's tests: ragkv.testing's (one torch thread, the embedder)."""

from __future__ import annotations

from ragkv.testing.fixtures import embedder, one_thread  # noqa: F401  (fixtures, re-exported)
