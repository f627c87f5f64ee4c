"""Joint encoding of KV blocks: BFF across requests, CFF across chunks, norm-aware attention."""

from ragkv.fusion.bff import (
    MULTI_MATCH,
    AutoThreshold,
    FusionConfig,
    FusionConfigError,
    FusionResult,
    fast_fusion,
    relative_errors,
)
from ragkv.fusion.cff import ChunkGroup, cff_fuse, cff_plan
from ragkv.fusion.norm_attention import norm_aware_attention, paged_norm_attention, replicate_rescaled

__all__ = [
    "MULTI_MATCH",
    "AutoThreshold",
    "ChunkGroup",
    "FusionConfig",
    "FusionConfigError",
    "FusionResult",
    "cff_fuse",
    "cff_plan",
    "fast_fusion",
    "norm_aware_attention",
    "paged_norm_attention",
    "relative_errors",
    "replicate_rescaled",
]
