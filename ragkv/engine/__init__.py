"""Serving engine: paged KV with shared blocks, fetching-aware continuous batching; KV backends (dense, HACK)
and block fusion (BFF/CFF) behind one interface each."""

from ragkv.engine.backend import KVBackend
from ragkv.engine.block_manager import BlockAccountingError, BlockManager, OutOfBlocksError
from ragkv.engine.engine import Engine, EngineConfig
from ragkv.engine.paged_cache import DenseBlocks, KVPool, PagedCacheError, PagedSequence, batched_decode_step
from ragkv.engine.provider import ChunkNotFoundError, ChunkRef, KVFetcher
from ragkv.engine.request import (
    Request,
    RequestFailedError,
    RequestHandle,
    RequestOutput,
    RequestStatus,
)
from ragkv.engine.scheduler import EngineBusyError, RequestTooLargeError, Scheduler, SchedulerConfig
from ragkv.fusion.paged import BlockFusion, FusionStats
from ragkv.metrics import percentile
from ragkv.metrics.serving import EngineMetrics, RequestMetrics

__all__ = [
    "BlockAccountingError",
    "BlockFusion",
    "BlockManager",
    "ChunkNotFoundError",
    "ChunkRef",
    "DenseBlocks",
    "Engine",
    "EngineBusyError",
    "EngineConfig",
    "EngineMetrics",
    "FusionStats",
    "KVBackend",
    "KVFetcher",
    "KVPool",
    "OutOfBlocksError",
    "PagedCacheError",
    "PagedSequence",
    "Request",
    "RequestFailedError",
    "RequestHandle",
    "RequestMetrics",
    "RequestOutput",
    "RequestStatus",
    "RequestTooLargeError",
    "Scheduler",
    "SchedulerConfig",
    "batched_decode_step",
    "percentile",
]
