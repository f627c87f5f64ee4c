"""``ragkv.LLM``: load a model once, keep chunk KV, answer ``prefix + chunks + question`` in any mode."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ragkv.adapter.shipped import check_kv_source, kv_model, resolve_adapter
from ragkv.blend.core import BlendSchedule, PrefillResult
from ragkv.blend.gate import GateReport, ensure_gate, gate_report
from ragkv.blend.kvtree import KVTree, tree_store
from ragkv.blend.resolver import ChunkResolver
from ragkv.defaults import DEFAULT_ADAPTER
from ragkv.fidelity import OperatingPoint
from ragkv.fidelity.plan import BlendPlan, Planner, RequestSettings
from ragkv.generate import SamplingParams, TokenEvent, generate, stream
from ragkv.kv.chunk import ChunkKV
from ragkv.model.llama import Model
from ragkv.model.loader import load_model
from ragkv.model.registry import DEFAULT_MODEL
from ragkv.prompt import tokenize_parts

log = logging.getLogger("ragkv")


@dataclass
class Answer:
    """A generated answer with the prefill statistics and timings (seconds)."""

    text: str
    token_ids: list[int]
    mode: str
    finish_reason: str
    ttft_s: float
    total_s: float
    stats: dict = field(default_factory=dict)


class LLM:
    """A model plus its chunk-KV cache: ``generate(prefix, chunks, question, mode=..., ratio=...)``.

    ``store``: a ``ragkv.store`` chunk store that computed chunk KV is written to (a cache its owner
    manages), and the store tier of the exact KV tree (``kv_tree``: every exact prefill's KV, reused by
    longest token prefix, :mod:`ragkv.blend.kvtree`; its RAM budget is half of ``cache_bytes``); chunk
    KV is also kept in an in-process LRU of ``cache_bytes``.

    ``fidelity``: how ``mode="blend"`` without a ratio runs (``ragkv.fidelity``): ``"floor"`` (the
    default: the cheapest point of the model's fidelity report that changes no more answers than a
    dtype change does), ``"exact"``, ``"fast"`` / ``"fast:X"`` or a same-answer rate in (0, 1]. An
    explicit ``ratio=`` (or a ``schedule=``) runs as asked and is reported as outside the gate.

    ``adapter``: a KV adapter reused chunk KV is read through (``ragkv.adapter``): ``"auto"`` (the
    default) takes the package's adapter for the model if one ships, used only where the gate's report
    for the (model, adapter) pair meets the target more cheaply; a file or ``KVAdapter`` is used
    wherever chunk KV is reused; None: never. A chunk-KV writer's file (``ragkv adapter train --kind
    writer``) writes every chunk's KV through the writer and reads only such KV (keyed by the writer's
    fingerprint, docs/CHUNK_CONVENTION.md); where to run comes from the (model, writer) report.

    ``decode_weights``: what decode steps read when ``model`` is loaded here (``load_model``; None:
    ``$RAGKV_DECODE_WEIGHTS``, else ``"auto"``: the GGUF file's own low-bit blocks where the model is
    one); a :class:`Model` passed in decodes on whatever it was loaded with. Prefill never changes.

    ``schedule``, ``fidelity`` and ``adapter`` are parsed once into :attr:`settings` (a
    :class:`~ragkv.fidelity.plan.RequestSettings`: every request's defaults); ``settings`` may be
    given whole instead. Each call's ``mode``/``ratio``/``fidelity`` keywords are parsed the same way,
    and everything below runs the :class:`~ragkv.fidelity.plan.BlendPlan` they resolve to (:meth:`plan`).
    """

    def __init__(
        self,
        model: str | Model = DEFAULT_MODEL,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        store=None,
        cache_bytes: int = 2 << 30,
        kv_tree: KVTree | None = None,
        self_check_on_load: bool = True,
        attention: str = "fp16",
        schedule: BlendSchedule | None = None,
        fidelity: str | float | None = None,
        resolver: ChunkResolver | None = None,
        adapter=DEFAULT_ADAPTER,
        decode_weights: str | None = None,
        settings: RequestSettings | None = None,
    ):
        if settings is None:  # the edge: loose keywords parsed once (None adapter: "off", as before)
            settings = RequestSettings(schedule=schedule, fidelity=fidelity, adapter=adapter or "off")
        if isinstance(model, Model):
            if decode_weights not in (None, "auto", model.decode_weights):
                raise ValueError(
                    f"decode_weights={decode_weights!r} for a model loaded with {model.decode_weights!r}: "
                    "pass decode_weights to load_model"
                )
            self.model = model
        else:
            self.model = load_model(model, dtype=dtype, device=device, decode_weights=decode_weights)
        #: this LLM's request settings (every request's defaults; ``adapter`` is read here, once)
        self.settings = settings
        self.adapter, explicit = resolve_adapter(self.model, settings.adapter or DEFAULT_ADAPTER)
        #: turns a request's settings into the plan that runs (this LLM's model, settings and adapter)
        self.planner = Planner(self.model, settings, self.adapter, explicit)
        #: the model that writes and names chunk KV: the model itself, or with a chunk-KV writer on
        self.kv_model = kv_model(self.model, self.adapter)
        self.attention = attention
        #: the exact KV tree every exact prefill of this model reuses (RAM, then ``store``'s pages)
        self.kv_tree = kv_tree if kv_tree is not None else KVTree(cache_bytes // 2, tree_store(store))
        #: where chunk KV comes from (passed in, or one over ``store``); a :class:`ragkv.RAG` answers
        #: with a view of this LLM over its own resolver (:meth:`with_resolver`)
        self.resolver = resolver or ChunkResolver(
            self.kv_model,
            store,
            cache_bytes=cache_bytes,
            pipelined=store is not None,
            background_writes=False,
        )
        check_kv_source(self.resolver, self.kv_model)
        if self_check_on_load:  # else it runs before the first reuse or blend (ragkv.blend.gate)
            ensure_gate(self.model)
        log.info("model %s: %s", self.model.name, self.operating_point().describe())

    def with_resolver(self, resolver: ChunkResolver) -> LLM:
        """A view of this LLM (same model, settings and prefix cache) whose chunk KV comes from
        ``resolver``, e.g. a RAG's, which writes back only what its index holds; this LLM is unchanged."""
        check_kv_source(resolver, self.kv_model)
        view = copy.copy(self)
        view.resolver = resolver
        return view

    def with_settings(self, settings: RequestSettings) -> LLM:
        """A view of this LLM (same model, adapter, resolver and KV tree) whose requests default to
        ``settings`` over this LLM's (an engine's config); ``settings.adapter`` must be unset."""
        if settings.adapter is not None:
            raise ValueError(
                "a view keeps its LLM's KV adapter (it names the chunk KV): give it to LLM(adapter=...)"
            )
        view = copy.copy(self)
        view.settings = settings.over(self.settings)
        view.planner = self.planner.under(settings)
        return view

    def with_kv_tree(self, kv_tree: KVTree) -> LLM:
        """A view of this LLM whose exact prefills reuse ``kv_tree`` (an owner's: one tree per model)."""
        view = copy.copy(self)
        view.kv_tree = kv_tree
        return view

    @property
    def gate(self) -> GateReport | None:
        """The blending self-check's report (None until it has run)."""
        return gate_report(self.model)

    def operating_point(self, fidelity: str | float | None = None) -> OperatingPoint:
        """Where ``mode="blend"`` without a ratio runs for ``fidelity`` (None: this LLM's setting),
        whatever mode and ratio this LLM's settings default to."""
        gate = dataclasses.replace(self.planner, settings=self.settings.changed(mode=None, ratio=None))
        return gate.plan(RequestSettings(mode="blend", fidelity=fidelity)).point

    def plan(self, request: RequestSettings | None = None) -> BlendPlan:
        """A request's settings as the :class:`BlendPlan` that runs, this LLM's settings filling what
        it leaves unset (:class:`~ragkv.fidelity.plan.Planner`)."""
        return self.planner.plan(request)

    # ---- tokens ---------------------------------------------------------------------------
    def tokenize_prompt(self, prefix, chunks, question, chat: bool | None = None, system: str | None = None):
        """Token ids ``(prefix, chunks, question)``: :func:`ragkv.prompt.tokenize_parts` (the one prompt
        convention) with this LLM's model."""
        return tokenize_parts(self.model, prefix, chunks, question, chat, system)

    # ---- chunk KV --------------------------------------------------------------------------
    @property
    def store(self):
        """The chunk store behind :attr:`resolver` (None: memory only)."""
        return self.resolver.store

    def chunk_kv(self, token_ids: Sequence[int]) -> ChunkKV:
        """The whole stored KV of a chunk: memory, then the store, else computed (see :attr:`resolver`)."""
        return self.resolver.kv(token_ids)

    # ---- answering -------------------------------------------------------------------------
    def prefill(
        self,
        prefix,
        chunks,
        question,
        mode: str | None = None,
        ratio: float | None = None,
        probe_suffix: bool = False,
        chat: bool | None = None,
        system: str | None = None,
        fidelity: str | float | None = None,
    ) -> PrefillResult:
        """Prefill ``prefix + chunks + question`` in ``mode`` (None: this LLM's, else ``blend``); the
        prefix's KV is cached and reused by every mode but ``full`` (the baseline that computes
        everything). With no ``chunks`` (a flat prompt, as frameworks format documents),
        ``reuse``/``blend`` find the stored chunks inside it (:meth:`ChunkResolver.locate`, when a
        corpus is known, e.g. a RAG's) and reuse their KV. ``ratio``: the share recomputed (None with
        ``blend``: the fidelity gate's operating point, :meth:`plan`); the point used is in
        ``stats["fidelity"]``."""
        plan = self.plan(RequestSettings(mode, ratio, fidelity=fidelity))
        return self.prefill_plan(prefix, chunks, question, plan, probe_suffix, chat, system)

    def prefill_plan(
        self,
        prefix,
        chunks,
        question,
        plan: BlendPlan,
        probe_suffix: bool = False,
        chat: bool | None = None,
        system: str | None = None,
    ) -> PrefillResult:
        """:meth:`prefill` of a planned request (:meth:`plan`)."""
        pre, chs, q = self.tokenize_prompt(prefix, chunks, question, chat, system)
        items = self.resolver.items(chs) if plan.reuses else chs
        located = None
        if plan.reuses and not chs:  # a flat prompt: stored chunks found inside it
            located = self.resolver.locate(pre + q)
            if located is not None:
                pre, items, q = located
        res = self.resolver.prefill(pre, items, q, plan, prefix_cache=self.kv_tree, probe_suffix=probe_suffix)
        if located is not None:
            res.stats["located_chunks"] = sum(not isinstance(it, list) for it in items)
        res.stats["fidelity"] = plan.stats()
        return res

    def generate(
        self,
        prefix: str | Sequence[int],
        chunks: Sequence[str | Sequence[int]],
        question: str | Sequence[int],
        mode: str | None = None,
        ratio: float | None = None,
        params: SamplingParams | None = None,
        chat: bool | None = None,
        system: str | None = None,
        fidelity: str | float | None = None,
        **sampling,
    ) -> Answer:
        """Answer ``question`` over ``chunks``; TTFT covers chunk-KV lookup, prefill and the first token.

        ``chat``/``system``: see :meth:`tokenize_prompt` (the chat template is used when the model
        has one); ``fidelity``: this call's setting (see :class:`LLM`); ``sampling``:
        :class:`SamplingParams` fields (``max_new_tokens``, ``temperature``...).
        """
        params = params or SamplingParams(**sampling)
        t0 = time.perf_counter()
        plan = self.plan(RequestSettings(mode, ratio, fidelity=fidelity))
        res = self.prefill_plan(prefix, chunks, question, plan, chat=chat, system=system)
        ttft = time.perf_counter() - t0
        gen = generate(self.model, res, params, attention=self.attention)
        return Answer(
            gen.text,
            gen.token_ids,
            res.stats["mode"],
            gen.finish_reason,
            ttft,
            time.perf_counter() - t0,
            {**res.stats, **gen.timings},
        )

    def stream(
        self,
        prefix,
        chunks,
        question,
        mode: str | None = None,
        ratio: float | None = None,
        params: SamplingParams | None = None,
        chat: bool | None = None,
        system: str | None = None,
        fidelity: str | float | None = None,
        **sampling,
    ) -> Iterator[TokenEvent]:
        """Like :meth:`generate` but yields tokens as they are produced."""
        params = params or SamplingParams(**sampling)
        plan = self.plan(RequestSettings(mode, ratio, fidelity=fidelity))
        res = self.prefill_plan(prefix, chunks, question, plan, chat=chat, system=system)
        yield from stream(self.model, res, params, attention=self.attention)
