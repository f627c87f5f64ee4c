"""Fetching-aware continuous batching: which requests fetch, which prefill, under a KV-block budget.

Queues (KVFetcher §3.3.1, Fig. 15):

* ``waiting``: submitted requests, FCFS;
* ``waiting_for_kv``: requests whose chunk KV is being fetched by the background fetcher. They are
  moved there as soon as they are seen (up to ``max_fetching`` in flight), whatever their position,
  so a slow fetch never blocks the requests behind it;
* ``ready``: fetched requests, admitted before newer ``waiting`` ones (they arrived earlier);
* ``running``: prefilled requests, decoded together every decode step.

Admission reserves, for the request's whole life, the blocks of its prompt plus ``max_new_tokens``
(``L * ceil((prompt + new) / block_size)``) against free blocks minus what running requests may
still allocate, so decode never runs out of blocks and nothing is ever preempted. Blocks freed by
BFF/CFF or prefix sharing immediately raise what can be admitted. (vLLM instead over-admits and
preempts; see docs/ENGINE.md.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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

    def __post_init__(self):
        for name in ("max_num_seqs", "max_queue", "max_prefill_tokens", "max_fetching"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass
class SchedulePlan:
    """What one engine step does."""

    fetch: list[Request] = field(default_factory=list)
    prefill: list[Request] = field(default_factory=list)


class Scheduler:
    """The queues and admission policy; the engine executes the plans."""

    def __init__(self, cfg: SchedulerConfig, manager: BlockManager, block_size: int, num_layers: int):
        self.cfg = cfg
        self.manager = manager
        self.block_size = block_size
        self.num_layers = num_layers
        self.waiting: deque[Request] = deque()
        self.waiting_for_kv: dict[str, Request] = {}
        self.ready: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_queued(self) -> int:
        return len(self.waiting) + len(self.waiting_for_kv) + len(self.ready)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` rows takes over all layers (no sharing assumed)."""
        return self.num_layers * (-(-num_tokens // self.block_size))

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

    def outstanding(self) -> int:
        """Blocks running requests may still allocate under their reservations."""
        return sum(max(0, r.reserve - r.seq.allocated) for r in self.running if r.seq is not None)

    def available(self) -> int:
        return self.manager.num_free - self.outstanding()

    def schedule(self, needs_fetch, prompt_tokens) -> SchedulePlan:
        """Plan a step. ``needs_fetch(req)``: chunk I/O needed; ``prompt_tokens(req)``: its length or None."""
        plan = SchedulePlan()
        # 1. requests needing remote KV leave ``waiting`` for ``waiting_for_kv`` (fetch-aware mode)
        if self.cfg.fetch_aware:
            keep: deque[Request] = deque()
            for r in self.waiting:
                if len(self.waiting_for_kv) < self.cfg.max_fetching and needs_fetch(r):
                    r.status = RequestStatus.WAITING_FOR_KV
                    self.waiting_for_kv[r.request_id] = r
                    plan.fetch.append(r)
                else:
                    keep.append(r)
            self.waiting = keep
        # 2. admission: fetched requests first, then waiting ones, FCFS, under slots/tokens/blocks
        slots = self.cfg.max_num_seqs - len(self.running)
        budget = self.available()
        tokens = 0
        for queue_ in (self.ready, self.waiting):
            while queue_ and slots > 0:
                r = queue_[0]
                if self.cfg.fetch_aware and queue_ is self.waiting and needs_fetch(r):
                    break  # it will move to waiting_for_kv once a fetch slot frees up
                n = prompt_tokens(r)
                if n is None:  # only in the blocking (not fetch-aware) mode: length known after the fetch
                    n = 0
                need = self.blocks_needed(n + r.params.max_new_tokens)
                if need > budget or (plan.prefill and tokens + n > self.cfg.max_prefill_tokens):
                    return plan
                queue_.popleft()
                r.reserve = need
                budget -= need
                tokens += n
                slots -= 1
                plan.prefill.append(r)
        return plan

    def fetched(self, req: Request) -> None:
        """A background fetch finished: the request becomes ready (if still tracked)."""
        if self.waiting_for_kv.pop(req.request_id, None) is not None:
            req.status = RequestStatus.READY
            self.ready.append(req)

    def remove(self, req: Request) -> None:
        """Forget a request wherever it is (finished, cancelled or failed)."""
        self.waiting_for_kv.pop(req.request_id, None)
        for q in (self.waiting, self.ready):
            try:
                q.remove(req)
            except ValueError:
                pass
        if req in self.running:
            self.running.remove(req)
