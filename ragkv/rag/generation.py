"""How a :class:`~ragkv.rag.RAG` generates once a prompt is built: a strategy.

Every entry point (``RAG.answer_stream``, ``RAG.stream_parts`` for framework prompts, the service's
``/v1/completions``) builds one :class:`PromptJob` (prompt token ids and the stored chunks inside it)
and hands it to the RAG's generator, so retrieval, the prompt, chunk lookup, cancellation and
reporting are the same whatever generates:

- :class:`ThreadGenerator` (default): prefill and decode in the calling thread; stored KV loaded
  layer by layer, pipelined, with the resolver's recompute-on-load-failure loop.
- :class:`EngineGenerator`: :mod:`ragkv.engine`, continuous batching over paged KV, shared by every
  caller (its fetcher uses the same resolver, so pipelining, recovery and write-back are the RAG's).
- ``ragkv.integrations.vllm.client.VllmGenerator``: a vLLM server with ragkv's plugin (an edge module: the
  library does not import it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ragkv.blend.locate import Located
from ragkv.blend.spans import check_cancelled
from ragkv.fidelity import OperatingPoint
from ragkv.generate import SamplingParams, TokenEvent, collect, stream

if TYPE_CHECKING:
    from ragkv.blend.core import BlendSchedule
    from ragkv.rag.pipeline import RAG


class OptionNotServedError(ValueError):
    """A request option this generator cannot honour (refused, never silently dropped)."""


@dataclass
class PromptJob:
    """A prompt to complete: its token ids, the stored chunks inside it, and how to prefill and sample."""

    prompt_ids: list[int]
    chunks: Sequence[Located]  # in prompt order, non-overlapping; rows [lo, hi) of each stored chunk
    mode: str
    ratio: float | str  # a number, or "auto" (the RAG's loading controller; threads only)
    params: SamplingParams
    schedule: BlendSchedule | None = None  # an explicit blend schedule (``/v1/completions``)
    write_back: bool = True  # computed chunk KV goes to the owner's write-back policy
    save: bool = False  # also store computed KV the policy would not (an explicit request)
    #: the fidelity gate's operating point this job runs at (``stats["fidelity"]`` of its answer)
    fidelity: OperatingPoint | None = None

    def parts(self) -> tuple[list[int], list[list[int]], list[int]]:
        """``(prefix, pieces, suffix)`` as token ids: each chunk's rows, and the text between them."""
        ids = self.prompt_ids
        if not self.chunks:
            return list(ids), [], []
        pieces, pos = [], self.chunks[0].start
        for c in self.chunks:
            if c.start > pos:
                pieces.append(list(ids[pos : c.start]))
            pieces.append(list(c.token_ids[c.lo : c.hi]))
            pos = c.stop
        return list(ids[: self.chunks[0].start]), pieces, list(ids[pos:])


@dataclass
class Generated:
    """How a generation ended: its text and tokens, finish reason, the mode that ran and its statistics."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    mode: str
    stats: dict = field(default_factory=dict)
    kv_fetch_s: float = 0.0  # waiting for stored KV (lookup, loads not hidden behind compute)
    timings: dict = field(default_factory=dict)  # anything else the generator measured


@runtime_checkable
class Generator(Protocol):
    """Completes a :class:`PromptJob`: token events as they come, then one :class:`Generated`."""

    name: str

    def stream(self, rag: RAG, job: PromptJob) -> Iterator[TokenEvent | Generated]: ...

    def close(self) -> None: ...


class ThreadGenerator:
    """Prefill and decode in the calling thread (the library's default; the service's worker threads)."""

    name = "threads"

    def stream(self, rag: RAG, job: PromptJob) -> Iterator[TokenEvent | Generated]:
        resolver = rag.resolver
        t0 = time.perf_counter()
        reuse = job.mode in ("reuse", "blend") and bool(job.chunks)
        if reuse:
            prefix, items, suffix = resolver.pieces(
                job.prompt_ids, job.chunks, write_back=job.write_back, check=check_cancelled
            )
            misses = len(job.chunks) - items.hits  # before prefill: a failed load counts as bad
        else:  # token lists: "prefix" mode caches the head segment by segment, "full" computes all
            prefix, items, suffix = job.parts()
        ratio, decision = rag.choose_ratio(job, items)
        bad = 0

        def recomputed(_toks: list[int]) -> None:
            nonlocal bad
            check_cancelled()
            bad += 1

        kw = {"schedule": job.schedule} if job.schedule is not None and job.mode == "blend" else {}
        t_lookup = time.perf_counter() - t0
        res = resolver.prefill(
            prefix,
            items,
            suffix,
            job.mode,
            ratio,
            write_back=job.write_back,
            on_recompute=recomputed,
            prefix_cache=rag.llm.prefix_cache,
            **kw,
        )
        stats = dict(res.stats)
        if reuse:
            saved = sum(resolver.save(kv) for kv in items.computed) if job.save else 0
            stats.update(kv_hits=items.hits, kv_misses=misses, kv_saved=saved)
            stats["num_chunks"] = len(job.chunks)  # text between chunks is not a chunk
        stats["kv_recomputed_bad"] = bad
        if job.fidelity is not None:
            stats["fidelity"] = job.fidelity.as_stats()
        if decision is not None:
            stats["controller"] = decision.as_dict()
        for item in collect(stream(rag.model, res, job.params, attention=rag.llm.attention)):
            if isinstance(item, tuple):
                text, out, reason = item
                wait = t_lookup + res.stats.get("t_load_wait_s", 0.0)
                yield Generated(text, out, reason, stats["mode"], stats, kv_fetch_s=wait)
            else:
                yield item

    def close(self) -> None:
        pass


class EngineGenerator:
    """Requests go to one :class:`ragkv.engine.Engine` (continuous batching; its own loop thread).

    The engine gets the prompt as ``prefix + pieces + suffix`` token ids; its fetcher resolves each
    piece by content through the RAG's resolver (text between chunks, and the part of a chunk a flat
    prompt cut, are misses computed like fresh chunks). Deviations, refused rather than dropped: the
    loading controller (``ratio="auto"``) and a per-request blend schedule other than a ratio.
    """

    name = "engine"

    def __init__(self, engine):
        self.engine = engine

    def stream(self, rag: RAG, job: PromptJob) -> Iterator[TokenEvent | Generated]:
        if job.ratio == "auto":
            raise OptionNotServedError("ratio 'auto' (the loading controller) is not served by the engine")
        ratio = float(job.ratio)
        if job.schedule is not None:
            if job.schedule != type(job.schedule).single(job.schedule.target_ratio):
                raise OptionNotServedError(
                    "the engine blends with its own schedule: send only a ratio (no check_layers, "
                    "selector, offsets or APE options)"
                )
            ratio = job.schedule.target_ratio
        prefix, pieces, suffix = job.parts()
        reuse = job.mode in ("reuse", "blend") and bool(job.chunks)
        if job.save:  # store the chunks' KV that the store lacks (asked explicitly by a writer)
            for c in job.chunks:
                if not rag.store.contains(c.key):
                    check_cancelled()
                    rag.resolver.save(rag.resolver.compute(c.token_ids, write_back=False))
        # what the engine's fetcher will find stored (it loads these and computes the rest)
        hits = sum(c.lo == 0 and c.hi == len(c.token_ids) and rag.store.contains(c.key) for c in job.chunks)
        self.engine.start()
        handle = self.engine.submit(prefix, pieces, suffix, job.params, mode=job.mode, ratio=ratio)
        try:
            yield from handle.stream(poll=check_cancelled)
        finally:
            if handle.request.finish_reason is None:  # the consumer stopped: free the request's KV
                handle.cancel()
        out = handle.request.output()
        m = out.metrics
        stats = {**out.prefill_stats, "finish_reason": out.finish_reason}
        if job.fidelity is not None:
            stats["fidelity"] = job.fidelity.as_stats()
        if reuse:
            stats.update(num_chunks=len(job.chunks), kv_hits=hits, kv_misses=len(job.chunks) - hits)
        timings = {"engine_queue_s": m.queue_s or 0.0}
        yield Generated(
            out.text,
            list(out.token_ids),
            out.finish_reason,
            str(stats.get("mode", job.mode)),
            stats,
            kv_fetch_s=m.fetch_s or 0.0,
            timings=timings,
        )

    def close(self) -> None:
        self.engine.shutdown()
