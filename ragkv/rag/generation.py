"""How a :class:`~ragkv.rag.RAG` generates once a prompt is built: a strategy.

Every entry point (``RAG.answer_stream``, ``RAG.stream_parts`` for framework prompts, the service's
``/v1/completions``) builds one :class:`PromptJob` (prompt token ids and the stored chunks inside it)
and hands it to the RAG's generator, so retrieval, the prompt, chunk lookup, cancellation and
reporting are the same whatever generates:

- :class:`ThreadGenerator` (default): prefill and decode in the calling thread; stored KV loaded
  layer by layer, pipelined, with the resolver's recompute-on-load-failure loop.
- :class:`EngineGenerator`: :mod:`ragkv.engine`, continuous batching over paged KV, shared by every
  caller (its fetcher uses the same resolver, so pipelining, recovery and write-back are the RAG's).
- ``ragkv.remote.client.VllmGenerator``: a vLLM server with the ragkv-vllm plugin, or a ragkv-server's
  ``/v1/completions`` (the core's; this module does not import it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ragkv.blend.locate import Located, split_at_chunks
from ragkv.blend.plan import BlendPlan
from ragkv.blend.spans import check_cancelled
from ragkv.generate import SamplingParams, TokenEvent, collect, stream
from ragkv.model.forward import decode_weights_of


class OptionNotServedError(ValueError):
    """A request option this generator cannot honour (refused, never silently dropped)."""


@dataclass
class PromptJob:
    """A prompt to complete: its token ids, the stored chunks inside it, what its prefill runs
    (:class:`~ragkv.blend.plan.BlendPlan`, resolved once by the RAG) and how to sample."""

    prompt_ids: list[int]
    chunks: Sequence[Located]  # in prompt order, non-overlapping; rows [lo, hi) of each stored chunk
    plan: BlendPlan
    params: SamplingParams
    write_back: bool = True  # computed chunk KV goes to the owner's write-back policy
    save: bool = False  # also store computed KV the policy would not (an explicit request)
    #: the loading controller's decision behind the plan's ratio (``ratio="auto"``), for the stats
    decision: object | None = None

    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def ratio(self) -> float | str:
        return self.plan.ratio

    @property
    def schedule(self):
        """The blend options beyond a ratio the request set (None: the default schedule)."""
        return self.plan.schedule

    @property
    def fidelity(self):
        """The fidelity gate's operating point this job runs at (``stats["fidelity"]`` of its answer)."""
        return self.plan.point

    def parts(self) -> tuple[list[int], list[list[int]], list[int]]:
        """``(prefix, pieces, suffix)`` as token ids: each chunk's rows, and the text between them."""
        prefix, pieces, suffix = split_at_chunks(self.prompt_ids, self.chunks)
        rows = [list(p.token_ids[p.lo : p.hi]) if isinstance(p, Located) else p for p in pieces]
        return prefix, rows, suffix


class GenerationContext(Protocol):
    """What a generator uses of the RAG that hands it a job: the model and its LLM settings (prefix
    cache, attention), and the one chunk resolver (with its store and counters)."""

    llm: object
    model: object
    resolver: object

    @property
    def store(self): ...


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

    def stream(self, rag: GenerationContext, job: PromptJob) -> Iterator[TokenEvent | Generated]: ...

    def close(self) -> None: ...


class ThreadGenerator:
    """Prefill and decode in the calling thread (the library's default; the service's worker threads)."""

    name = "threads"

    def stream(self, rag: GenerationContext, job: PromptJob) -> Iterator[TokenEvent | Generated]:
        if job.plan.auto:
            raise ValueError("ratio='auto' needs a LoadingController (RAG(controller=...))")
        resolver = rag.resolver
        t0 = time.perf_counter()
        reuse = job.plan.reuses and bool(job.chunks)
        if reuse:
            prefix, items, suffix = resolver.pieces(
                job.prompt_ids, job.chunks, write_back=job.write_back, check=check_cancelled
            )
            misses = len(job.chunks) - items.hits  # before prefill: a failed load counts as bad
        else:  # token lists: "prefix" mode caches the head segment by segment, "full" computes all
            prefix, items, suffix = job.parts()
        bad = 0

        def recomputed(_toks: list[int]) -> None:
            nonlocal bad
            check_cancelled()
            bad += 1

        t_lookup = time.perf_counter() - t0
        res = resolver.prefill(
            prefix,
            items,
            suffix,
            job.plan,
            write_back=job.write_back,
            on_recompute=recomputed,
            prefix_cache=rag.llm.kv_tree,
        )
        stats = dict(res.stats)
        if reuse:
            saved = sum(resolver.save(kv) for kv in items.computed) if job.save else 0
            stats.update(kv_hits=items.hits, kv_misses=misses, kv_saved=saved)
            stats["num_chunks"] = len(job.chunks)  # text between chunks is not a chunk
        stats["kv_recomputed_bad"] = bad
        stats["decode_weights"] = decode_weights_of(rag.model)
        if job.plan.point is not None:
            stats["fidelity"] = job.plan.stats()
        if job.decision is not None:
            stats["controller"] = job.decision.as_dict()
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

    def stream(self, rag: GenerationContext, job: PromptJob) -> Iterator[TokenEvent | Generated]:
        plan = job.plan
        if plan.auto or job.decision is not None:
            raise OptionNotServedError("ratio 'auto' (the loading controller) is not served by the engine")
        if plan.schedule is not None:
            if plan.schedule != type(plan.schedule).single(plan.schedule.target_ratio):
                raise OptionNotServedError(
                    "the engine blends with its own schedule: send only a ratio (no check_layers, "
                    "selector, offsets or APE options)"
                )
            plan = BlendPlan(plan.mode, plan.ratio, None, plan.point)  # a ratio alone
        prefix, pieces, suffix = job.parts()
        reuse = plan.reuses and bool(job.chunks)
        if job.save:  # store the chunks' KV that the store lacks (asked explicitly by a writer)
            for c in job.chunks:
                if not rag.store.contains(c.key):
                    check_cancelled()
                    rag.resolver.save(rag.resolver.compute(c.token_ids, write_back=False))
        # what the engine's fetcher will find stored (it loads these and computes the rest)
        hits = sum(c.lo == 0 and c.hi == len(c.token_ids) and rag.store.contains(c.key) for c in job.chunks)
        self.engine.start()
        handle = self.engine.submit(prefix, pieces, suffix, job.params, plan=plan)
        try:
            yield from handle.stream(poll=check_cancelled)
        finally:
            if handle.request.finish_reason is None:  # the consumer stopped: free the request's KV
                handle.cancel()
        out = handle.request.output()
        m = out.metrics
        stats = {**out.prefill_stats, "finish_reason": out.finish_reason}
        stats["decode_weights"] = decode_weights_of(self.engine.model)
        if plan.point is not None:
            stats["fidelity"] = plan.stats()
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
