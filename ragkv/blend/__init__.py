"""Blending: prefill modes (full, prefix, reuse, CacheBlend blend) over stored chunk KV."""

from ragkv.blend.core import (
    COMPUTED,
    DEFAULT_RATIO,
    EXACT,
    REUSED,
    BlendSchedule,
    PrefillResult,
    PromptKV,
    selective_prefill,
)
from ragkv.blend.kvtree import KVTree, PrefixCache, tree_store
from ragkv.blend.prefill import MODES, UnknownModeError, prefill
from ragkv.blend.resolver import ChunkNotFoundError, ChunkResolver
from ragkv.blend.source import LayerSource

__all__ = [
    "ChunkNotFoundError",
    "ChunkResolver",
    "COMPUTED",
    "DEFAULT_RATIO",
    "EXACT",
    "MODES",
    "REUSED",
    "BlendSchedule",
    "LayerSource",
    "PrefillResult",
    "KVTree",
    "PrefixCache",
    "tree_store",
    "PromptKV",
    "UnknownModeError",
    "prefill",
    "selective_prefill",
]
