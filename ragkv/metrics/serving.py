"""The engine's serving metrics: per-request timings (queue, fetch, TTFT, TPOT) and engine-wide counters
(throughput, KV blocks); plain values, filled by `ragkv.engine`."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock instants (``time.perf_counter``) of one request's life and what it cost."""

    arrival: float = field(default_factory=time.perf_counter)
    fetch_start: float | None = None
    fetch_end: float | None = None
    prefill_start: float | None = None
    prefill_end: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_chunks_fetched: int = 0
    blocks_shared_at_load: int = 0

    @property
    def queue_s(self) -> float | None:
        """Arrival until fetching or prefill started (time spent waiting for the scheduler)."""
        start = self.fetch_start if self.fetch_start is not None else self.prefill_start
        return None if start is None else start - self.arrival

    @property
    def fetch_s(self) -> float:
        if self.fetch_start is None or self.fetch_end is None:
            return 0.0
        return self.fetch_end - self.fetch_start

    @property
    def prefill_s(self) -> float | None:
        if self.prefill_start is None or self.prefill_end is None:
            return None
        return self.prefill_end - self.prefill_start

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token is None or self.last_token is None or self.num_output_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.num_output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    def as_dict(self) -> dict:
        d = asdict(self)
        for name in ("queue_s", "fetch_s", "prefill_s", "ttft_s", "tpot_s", "e2e_s"):
            d[name] = getattr(self, name)
        return d


@dataclass
class EngineMetrics:
    """A snapshot of the engine: throughput, queue sizes, KV blocks and compression."""

    uptime_s: float
    requests_finished: int
    requests_cancelled: int
    requests_failed: int
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    waiting: int
    waiting_for_kv: int
    ready: int
    running: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_peak: int
    kv_bytes_used: int
    kv_bytes_peak: int
    compression_ratio: float  # logical block references / physical blocks in use
    preemptions: int  # running requests whose blocks were taken back (recomputed later)
    steps: int
    prefill_steps: int
    decode_steps: int
    bff: dict
    cff: dict

    def as_dict(self) -> dict:
        return asdict(self)
