"""Chunk KV: a chunk's per-layer K/V, keyed by content and model (computed by
:func:`ragkv.model.forward.compute_chunk_kv`)."""

from ragkv.kv.chunk import CHUNK_CONVENTION_VERSION, ChunkKV, KVMismatchError, chunk_key

__all__ = ["CHUNK_CONVENTION_VERSION", "ChunkKV", "KVMismatchError", "chunk_key"]
