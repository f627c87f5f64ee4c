"""``ragkv.LLM``: load a model once, keep chunk KV, answer ``prefix + chunks + question`` in any mode."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ragkv.blend.core import DEFAULT_RATIO, BlendSchedule, PrefillResult
from ragkv.blend.gate import GateReport, ensure_gate, gate_report
from ragkv.blend.prefix_cache import PrefixCache
from ragkv.blend.resolver import ChunkResolver
from ragkv.fidelity import OperatingPoint, explicit_point, operating_point, parse_fidelity
from ragkv.generate import SamplingParams, TokenEvent, generate, stream
from ragkv.kv.chunk import ChunkKV
from ragkv.model.chat import chat_parts, has_chat_template
from ragkv.model.llama import Model
from ragkv.model.loader import load_model
from ragkv.model.registry import DEFAULT_MODEL

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
    manages); chunk KV is also kept in an in-process LRU of ``cache_bytes``.

    ``fidelity``: how ``mode="blend"`` without a ratio runs (``ragkv.fidelity``): ``"floor"`` (the
    default: the cheapest point of the model's fidelity report that changes no more answers than a
    dtype change does), ``"exact"``, ``"fast"`` / ``"fast:X"`` or a same-answer rate in (0, 1]. An
    explicit ``ratio=`` (or a ``schedule=``) runs as asked and is reported as outside the gate.
    """

    def __init__(
        self,
        model: str | Model = DEFAULT_MODEL,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        store=None,
        cache_bytes: int = 2 << 30,
        self_check_on_load: bool = True,
        attention: str = "fp16",
        schedule: BlendSchedule | None = None,
        fidelity: str | float | None = None,
    ):
        self.fidelity = parse_fidelity(fidelity)
        self.model = model if isinstance(model, Model) else load_model(model, dtype=dtype, device=device)
        self.attention = attention
        self.schedule = schedule
        self.prefix_cache = PrefixCache(max_bytes=cache_bytes // 4)
        #: where chunk KV comes from; a :class:`ragkv.RAG` replaces it with one that writes back only
        #: the KV of chunks its index holds
        self.resolver = ChunkResolver(
            self.model, store, cache_bytes=cache_bytes, pipelined=store is not None, background_writes=False
        )
        if self_check_on_load:  # else it runs before the first reuse or blend (ragkv.blend.gate)
            ensure_gate(self.model)
        log.info("model %s: %s", self.model.name, self.operating_point().describe())

    @property
    def gate(self) -> GateReport | None:
        """The blending self-check's report (None until it has run)."""
        return gate_report(self.model)

    def operating_point(self, fidelity: str | float | None = None) -> OperatingPoint:
        """Where ``mode="blend"`` without a ratio runs for ``fidelity`` (None: this LLM's setting)."""
        if self.schedule is not None:  # the caller's own schedule: its ratios are theirs
            return explicit_point("blend", self.schedule.target_ratio)
        return operating_point(self.model, self.fidelity if fidelity is None else fidelity, self.schedule)

    def plan(
        self, mode: str, ratio: float | None, fidelity: str | float | None = None
    ) -> tuple[str, float | None, OperatingPoint]:
        """The one place a request's (mode, ratio, fidelity) becomes what runs: ``blend`` without a
        ratio takes the fidelity gate's point; anything explicit runs as asked, marked outside the gate."""
        if fidelity is not None:
            fidelity = parse_fidelity(fidelity)
        if mode == "blend" and ratio is None:
            op = self.operating_point(fidelity)
            return op.mode, op.ratio, op
        return mode, ratio, explicit_point(mode, ratio)

    # ---- tokens ---------------------------------------------------------------------------
    def tokenize_prompt(
        self,
        prefix: str | Sequence[int],
        chunks: Sequence[str | Sequence[int]],
        question: str | Sequence[int],
        chat: bool | None = None,
        system: str | None = None,
    ) -> tuple[list[int], list[int], list[int]]:
        """Token ids of the three parts, each tokenized apart (chunks keep their own, reusable KV).

        With a chat template (``chat=None``: when the model has one; strings only) the prompt is one
        user turn ``prefix + chunks + question`` rendered by the template, ending with the assistant
        turn's header, and ``system`` replaces the template's default system prompt. Without one,
        the prefix starts with BOS if the tokenizer would add it. Token-id parts are used as given.
        """
        m = self.model
        chs = [m.encode(c) if isinstance(c, str) else list(c) for c in chunks]
        texts = isinstance(prefix, str) and isinstance(question, str)
        if chat is None:
            chat = texts and has_chat_template(m)
        if chat:
            if not texts:
                raise ValueError("chat=True needs the prefix and question as strings")
            head = f"{prefix}\n\n" if prefix else ""
            tail = f"\n\n{question}" if chs else question
            pre, q = chat_parts(m, head, tail, system=system)
            return pre, chs, q
        pre = m.encode(prefix, add_bos=True) if isinstance(prefix, str) else list(prefix)
        q = m.encode(question) if isinstance(question, str) else list(question)
        return pre, chs, q

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
        mode: str = "blend",
        ratio: float | None = None,
        probe_suffix: bool = False,
        chat: bool | None = None,
        system: str | None = None,
        fidelity: str | float | None = None,
    ) -> PrefillResult:
        """Prefill ``prefix + chunks + question`` in ``mode``; the prefix's KV is cached and reused by
        every mode but ``full`` (the baseline that computes everything). With no ``chunks`` (a flat
        prompt, as frameworks format documents), ``reuse``/``blend`` find the stored chunks inside it
        (:meth:`ChunkResolver.locate`, when a corpus is known, e.g. a RAG's) and reuse their KV.
        ``ratio``: the share recomputed (None with ``blend``: the fidelity gate's operating point,
        :meth:`plan`); the point used is in ``stats["fidelity"]``."""
        mode, ratio, op = self.plan(mode, ratio, fidelity)
        pre, chs, q = self.tokenize_prompt(prefix, chunks, question, chat, system)
        items = self.resolver.items(chs) if mode in ("reuse", "blend") else chs
        located = None
        if mode in ("reuse", "blend") and not chs:  # a flat prompt: stored chunks found inside it
            located = self.resolver.locate(pre + q)
            if located is not None:
                pre, items, q = located
        sched = self._schedule(ratio) if mode == "blend" else None
        ratio = DEFAULT_RATIO if ratio is None else ratio
        res = self.resolver.prefill(
            pre,
            items,
            q,
            mode,
            ratio,
            schedule=sched,
            prefix_cache=self.prefix_cache,
            probe_suffix=probe_suffix,
        )
        if located is not None:
            res.stats["located_chunks"] = sum(not isinstance(it, list) for it in items)
        res.stats["fidelity"] = op.as_stats()
        return res

    def _schedule(self, ratio: float | None) -> BlendSchedule | None:
        """This LLM's schedule with a per-call ``ratio`` applied (refused if it has several ratios)."""
        if self.schedule is None or ratio is None or (ratio,) == self.schedule.ratios:
            return self.schedule
        if len(self.schedule.ratios) != 1:
            raise ValueError(
                f"this LLM's blend schedule has ratios {self.schedule.ratios}; a per-call ratio cannot "
                "replace them (pass ratio=None, or set LLM.schedule)"
            )
        return dataclasses.replace(self.schedule, ratios=(float(ratio),))

    def generate(
        self,
        prefix: str | Sequence[int],
        chunks: Sequence[str | Sequence[int]],
        question: str | Sequence[int],
        mode: str = "blend",
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
        res = self.prefill(prefix, chunks, question, mode, ratio, chat=chat, system=system, fidelity=fidelity)
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
        mode: str = "blend",
        ratio: float | None = None,
        params: SamplingParams | None = None,
        chat: bool | None = None,
        system: str | None = None,
        fidelity: str | float | None = None,
        **sampling,
    ) -> Iterator[TokenEvent]:
        """Like :meth:`generate` but yields tokens as they are produced."""
        params = params or SamplingParams(**sampling)
        res = self.prefill(prefix, chunks, question, mode, ratio, chat=chat, system=system, fidelity=fidelity)
        yield from stream(self.model, res, params, attention=self.attention)
