"""Fetching-aware continuous batching (KVFetcher §3.3.1): which requests fetch, which prefill.

Queues: ``waiting`` (FCFS), ``waiting_for_kv`` (fetching in the background: moved there as soon as
seen, so a slow fetch never blocks the requests behind it), ``ready`` (fetched or preempted: admitted
before newer waiting ones), ``running`` (decoding, in admission order). A request is admitted when its
prompt's blocks (shared head blocks not counted) fit the free blocks less one per layer per running
request; decode may still run out, and the engine then preempts the newest (:meth:`Scheduler.preempt`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ragkv.engine.block_manager import BlockManager
from ragkv.engine.request import Request, RequestStatus


class EngineBusyError(RuntimeError):
    """The engine's queue is full (``max_queue`` requests not yet running): retry later."""


class RequestTooLargeError(ValueError):
    """The request can never fit the KV pool (prompt + max_new_tokens exceeds every block)."""


@dataclass
class SchedulerConfig:
    """Limits of the scheduler."""

    max_num_seqs: int = 64  # running (decoding) requests at most
    max_queue: int = 256  # requests queued but not running (waiting + waiting_for_kv + ready)
    max_prefill_tokens: int = 8192  # prompt tokens prefilled in one step (at least one request)
    max_fetching: int = 64  # requests fetching at once
    fetch_aware: bool = True  # False: fetch synchronously in the engine step (the baseline)
    #: admit waiting requests with the longest cached prefix (share of their prompt) first, RAGCache's
    #: cache-aware reordering; a request that waited ``max_wait_s`` goes first whatever it shares
    cache_aware: bool = True
    max_wait_s: float = 2.0

    def __post_init__(self):
        for name in ("max_num_seqs", "max_queue", "max_prefill_tokens", "max_fetching"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class Scheduler:
    """The queues and admission policy; the engine executes what it decides."""

    def __init__(self, cfg: SchedulerConfig, manager: BlockManager, block_size: int, num_layers: int):
        self.cfg, self.manager, self.block_size, self.num_layers = cfg, manager, block_size, num_layers
        self.waiting: deque[Request] = deque()
        self.waiting_for_kv: dict[str, Request] = {}
        self.ready: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_queued(self) -> int:
        return len(self.waiting) + len(self.waiting_for_kv) + len(self.ready)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` rows takes over all layers (no sharing)."""
        return self.num_layers * -(-num_tokens // self.block_size)

    def check_fits(self, req: Request, num_prompt_tokens: int) -> None:
        need = self.blocks_needed(num_prompt_tokens + req.params.max_new_tokens)
        if need > self.manager.num_blocks:
            raise RequestTooLargeError(
                f"request {req.request_id} needs {need} KV blocks ({num_prompt_tokens} prompt + "
                f"{req.params.max_new_tokens} new tokens) but the pool has {self.manager.num_blocks}"
            )

    def add(self, req: Request) -> None:
        """Queue a request (the engine enforces ``max_queue`` at submission, see EngineBusyError)."""
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def fetches(self, local: Callable[[Request], bool]) -> list[Request]:
        """Move waiting requests whose chunk KV is not ``local`` to ``waiting_for_kv`` (up to
        ``max_fetching`` in flight); returns them, for the engine to start their fetches."""
        out, keep, room = [], deque(), self.cfg.max_fetching - len(self.waiting_for_kv)
        for r in self.waiting:
            (out if len(out) < room and not local(r) else keep).append(r)
        self.waiting = keep  # first out of one queue, then into the other: never counted twice
        for r in out:
            r.status = RequestStatus.WAITING_FOR_KV
            self.waiting_for_kv[r.request_id] = r
        return out

    def order_waiting(
        self, cached: Callable[[Request], tuple[int, int, tuple]], now: float | None = None
    ) -> None:
        """Reorder ``waiting`` cache-aware: requests that waited ``max_wait_s`` first (FCFS among them),
        then by the cached share of their prompt. Of two requests whose uncached parts start alike (the
        same ``cached(r)[2]``: their next tokens after the same cached length), only the first stays in
        front: the second goes after every other, so it runs once the first's KV is in the tree.
        ``cached(r)``: (cached tokens, prompt tokens, the key of its first uncached tokens)."""
        if not self.cfg.cache_aware or len(self.waiting) < 2:
            return
        now = time.perf_counter() if now is None else now
        info = {id(r): cached(r) for r in self.waiting}
        seen: set = set()
        front, later = [], []
        for r in sorted(
            self.waiting,
            key=lambda r: (
                now - r.metrics.arrival < self.cfg.max_wait_s,  # the starving first
                -info[id(r)][0] / max(info[id(r)][1], 1),
                r.metrics.arrival,
            ),
        ):
            key = info[id(r)][2]
            (later if key in seen and now - r.metrics.arrival < self.cfg.max_wait_s else front).append(r)
            seen.add(key)
        self.waiting = deque(front + later)

    def admit(
        self,
        local: Callable[[Request], bool],
        cost: Callable[[Request], tuple[int, int]],
        shares: Callable[[Request, Request], bool] | None = None,
    ) -> list[Request]:
        """Requests to prefill now (``ready``, then local ``waiting`` ones, in queue order) under the
        running slots, the prefill token budget and the free blocks; ``cost(r)``: (prompt tokens, blocks
        taken now). ``shares(a, b)``: b's uncached prefix starts as a's: b waits for the next step, when
        a's KV is in the tree."""
        out, tokens = [], 0
        slots = self.cfg.max_num_seqs - len(self.running)
        budget = self.manager.num_free - self.num_layers * len(self.running)
        for queue_ in (self.ready, self.waiting):
            while queue_ and slots > 0:
                r = queue_[0]
                if queue_ is self.waiting and not local(r):
                    break  # it will move to waiting_for_kv once a fetch slot frees up
                if queue_ is self.waiting and shares is not None and any(shares(a, r) for a in out):
                    return out
                n, blocks = cost(r)
                if blocks > budget or (out and tokens + n > self.cfg.max_prefill_tokens):
                    return out
                queue_.popleft()
                budget -= blocks + self.num_layers
                tokens += n
                slots -= 1
                out.append(r)
        return out

    def fetched(self, req: Request) -> None:
        """A background fetch finished: the request becomes ready (if still tracked)."""
        if self.waiting_for_kv.pop(req.request_id, None) is not None:
            req.status = RequestStatus.READY
            self.ready.append(req)

    def preempt(self, req: Request) -> None:
        """A running request gives its blocks back: first in line again (``ready``), recomputed then."""
        self.running.remove(req)
        req.status = RequestStatus.READY
        self.ready.appendleft(req)

    def remove(self, req: Request) -> None:
        """Forget a request wherever it is (finished, cancelled or failed)."""
        self.waiting_for_kv.pop(req.request_id, None)
        for q in (self.waiting, self.ready, self.running):
            if req in q:
                q.remove(req)
