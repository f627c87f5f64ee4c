"""Chunk KV: prefill a chunk alone, keep its per-layer K/V, key it by content and model."""

from ragkv.kv.chunk import CHUNK_CONVENTION_VERSION, ChunkKV, KVMismatchError, chunk_key
from ragkv.kv.compute import compute_chunk_kv

__all__ = [
    "CHUNK_CONVENTION_VERSION",
    "ChunkKV",
    "KVMismatchError",
    "chunk_key",
    "compute_chunk_kv",
]
