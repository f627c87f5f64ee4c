"""Attention kernels: dense attention and HACK homomorphic attention on quantized KV.

HACK names are imported lazily (module ``__getattr__``) so that ``ragkv.attention.dense``, which the
model runtime imports, never pulls in the HACK cache (which itself imports the runtime's KVCache).
Nothing here needs triton or CUDA: the Triton kernel lives in ``ragkv.attention.hack_triton`` and
is guarded there.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "HackCacheError": "ragkv.attention.hack_cache",
    "HackConfig": "ragkv.attention.hack_cache",
    "HackKVCache": "ragkv.attention.hack_cache",
    "HackConfigError": "ragkv.attention.hack_quant",
    "HackError": "ragkv.attention.hack_quant",
    "HackQuantError": "ragkv.attention.hack_quant",
    "HackLayerView": "ragkv.attention.hack_ref",
    "HackPagedError": "ragkv.attention.hack_paged",
    "HackTailError": "ragkv.attention.hack_paged",
    "PagedLayout": "ragkv.attention.hack_paged",
    "TailPool": "ragkv.attention.hack_paged",
    "hack_attention": "ragkv.attention.hack_ref",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    """Import HACK names on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ragkv.attention' has no attribute {name!r}")
