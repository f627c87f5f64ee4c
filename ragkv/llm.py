"""``ragkv.LLM``: load a model once, keep chunk KV, answer ``prefix + chunks + question`` in any mode."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ragkv.blend.core import DEFAULT_RATIO, BlendSchedule, PrefillResult
from ragkv.blend.gate import GateReport, self_check
from ragkv.blend.prefill import prefill
from ragkv.blend.prefix_cache import PrefixCache
from ragkv.generate import SamplingParams, TokenEvent, generate, stream
from ragkv.kv.chunk import ChunkKV, chunk_key
from ragkv.kv.compute import compute_chunk_kv
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

    ``store`` is any object with ``get(key, fingerprint) -> ChunkKV | None`` and ``put(ChunkKV)``
    (see ``ragkv.store``); without one, chunk KV is kept in an in-process LRU of ``cache_bytes``.
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
    ):
        self.model = model if isinstance(model, Model) else load_model(model, dtype=dtype, device=device)
        self.store = store
        self.attention = attention
        self.schedule = schedule
        self.prefix_cache = PrefixCache(max_bytes=cache_bytes // 4)
        self._mem: OrderedDict[str, ChunkKV] = OrderedDict()
        self._mem_bytes = 0
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self.gate: GateReport | None = self_check(self.model) if self_check_on_load else None

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
    def chunk_kv(self, token_ids: Sequence[int]) -> ChunkKV:
        """Stored KV of a chunk: in-process cache, then the store, else computed and stored."""
        key = chunk_key(list(token_ids), self.model.fingerprint)
        with self._lock:
            kv = self._mem.get(key)
            if kv is not None:
                self._mem.move_to_end(key)
                return kv
        kv = self.store.get(key, self.model.fingerprint) if self.store is not None else None
        if kv is None:
            kv = compute_chunk_kv(self.model, list(token_ids))
            if self.store is not None:
                self.store.put(kv)
        self._remember(key, kv)
        return kv

    def _remember(self, key: str, kv: ChunkKV) -> None:
        with self._lock:
            if key in self._mem:
                return
            self._mem[key] = kv
            self._mem_bytes += kv.nbytes()
            while self._mem_bytes > self._cache_bytes and len(self._mem) > 1:
                _, old = self._mem.popitem(last=False)
                self._mem_bytes -= old.nbytes()

    # ---- answering -------------------------------------------------------------------------
    def prefill(
        self,
        prefix,
        chunks,
        question,
        mode: str = "blend",
        ratio: float = DEFAULT_RATIO,
        probe_suffix: bool = False,
        chat: bool | None = None,
        system: str | None = None,
    ) -> PrefillResult:
        """Prefill ``prefix + chunks + question`` in ``mode``; the prefix's KV is cached and reused by
        every mode but ``full`` (the baseline that computes everything)."""
        pre, chs, q = self.tokenize_prompt(prefix, chunks, question, chat, system)
        items = [self.chunk_kv(c) for c in chs] if mode in ("reuse", "blend") else chs
        sched = self.schedule if (self.schedule and mode == "blend") else None
        return prefill(
            self.model,
            pre,
            items,
            q,
            mode,
            ratio,
            schedule=sched,
            prefix_cache=self.prefix_cache,
            probe_suffix=probe_suffix,
        )

    def generate(
        self,
        prefix: str | Sequence[int],
        chunks: Sequence[str | Sequence[int]],
        question: str | Sequence[int],
        mode: str = "blend",
        ratio: float = DEFAULT_RATIO,
        params: SamplingParams | None = None,
        chat: bool | None = None,
        system: str | None = None,
        **sampling,
    ) -> Answer:
        """Answer ``question`` over ``chunks``; TTFT covers chunk-KV lookup, prefill and the first token.

        ``chat``/``system``: see :meth:`tokenize_prompt` (the chat template is used when the model
        has one); ``sampling``: :class:`SamplingParams` fields (``max_new_tokens``, ``temperature``...).
        """
        params = params or SamplingParams(**sampling)
        t0 = time.perf_counter()
        res = self.prefill(prefix, chunks, question, mode, ratio, chat=chat, system=system)
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
        ratio: float = DEFAULT_RATIO,
        params: SamplingParams | None = None,
        chat: bool | None = None,
        system: str | None = None,
        **sampling,
    ) -> Iterator[TokenEvent]:
        """Like :meth:`generate` but yields tokens as they are produced."""
        params = params or SamplingParams(**sampling)
        res = self.prefill(prefix, chunks, question, mode, ratio, chat=chat, system=system)
        yield from stream(self.model, res, params, attention=self.attention)
