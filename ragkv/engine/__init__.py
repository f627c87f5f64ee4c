"""Serving engine: paged KV with shared blocks, fetching-aware continuous batching, BFF/CFF, HACK decode."""

from ragkv.engine.block_manager import BlockAccountingError, BlockManager, OutOfBlocksError
from ragkv.engine.engine import Engine, EngineConfig
from ragkv.engine.metrics import EngineMetrics, FusionStats, RequestMetrics
from ragkv.engine.paged_cache import KVPool, PagedCacheError, PagedSequence, batched_decode_step
from ragkv.engine.provider import ChunkNotFoundError, ChunkRef, KVFetcher
from ragkv.engine.request import (
    Request,
    RequestFailedError,
    RequestHandle,
    RequestOutput,
    RequestStatus,
)
from ragkv.engine.scheduler import EngineBusyError, RequestTooLargeError, Scheduler, SchedulerConfig
from ragkv.metrics import percentile

__all__ = [
    "BlockAccountingError",
    "BlockManager",
    "ChunkNotFoundError",
    "ChunkRef",
    "Engine",
    "EngineBusyError",
    "EngineConfig",
    "EngineMetrics",
    "FusionStats",
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
