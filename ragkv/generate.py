"""Token generation after any prefill mode: greedy or sampled, stop strings/tokens, streaming."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ragkv.attention.kvcache import DenseKVCache, KVCache
from ragkv.blend.core import PrefillResult
from ragkv.model.forward import run_layers

#: temperatures below this sample greedily (dividing logits by ~1e-300 overflows to NaN probabilities)
MIN_TEMPERATURE = 1e-4


@dataclass
class SamplingParams:
    """Decoding settings; ``temperature == 0`` means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS ids

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)


@dataclass
class TokenEvent:
    """One generated token and the text it adds (may be empty mid multi-byte character)."""

    token_id: int
    text: str
    index: int


class Detokenizer:
    """One generation's output, token by token: stop tokens, stop strings, incremental text.

    The one stop/detokenize step of :func:`stream` and of the engine (``Engine._accept``).
    :meth:`accept` takes a sampled token and returns the event to emit (None for a stop token)
    and the finish reason ("stop", "length", or None to go on). A token that completes a stop
    string is kept (as vLLM keeps it), with its text cut before the stop string.
    """

    def __init__(self, model, params: SamplingParams):
        self.decode = model.decode
        self.max_new_tokens = params.max_new_tokens
        self.stop = tuple(s for s in params.stop if s)
        ids = params.stop_token_ids if params.stop_token_ids is not None else model.config.eos_token_ids
        self.stop_ids = frozenset(ids)
        self.ids: list[int] = []
        self.text = ""

    @property
    def done(self) -> bool:
        """No more tokens may be generated (``max_new_tokens`` reached)."""
        return len(self.ids) >= self.max_new_tokens

    def accept(self, tok: int) -> tuple[TokenEvent | None, str | None]:
        """``(event, finish reason)`` after sampling ``tok``."""
        if tok in self.stop_ids:
            return None, "stop"
        i = len(self.ids)
        self.ids.append(tok)
        prev = len(self.text)
        new_text = self.decode(self.ids)
        hit = next((s for s in self.stop if s in new_text), None)
        if hit is not None:
            cut = new_text.index(hit)
            self.text = new_text[:cut]
            return TokenEvent(tok, new_text[prev:cut] if cut > prev else "", i), "stop"
        delta = new_text[prev:] if new_text.startswith(self.text) else new_text
        self.text = new_text
        return TokenEvent(tok, delta, i), ("length" if self.done else None)


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    timings: dict = field(default_factory=dict)


def make_cache(model, attention: str = "fp16", capacity: int = 256, **hack_options) -> KVCache:
    """The decode KV cache for ``attention``: ``"fp16"`` (dense, model dtype) or ``"hack"`` (2-bit)."""
    if attention in ("fp16", "dense"):
        return DenseKVCache.for_model(model, capacity)
    if attention == "hack":
        from ragkv.attention.hack_cache import HackKVCache

        return HackKVCache.for_model(model, **hack_options)
    raise ValueError(f"unknown attention {attention!r}; use 'fp16' or 'hack'")


def load_prompt(cache: KVCache, result: PrefillResult) -> None:
    """Write a prefill's KV into a decode cache."""
    kv = result.kv
    for layer in range(kv.k.shape[0]):
        cache.write(layer, kv.positions, kv.k[layer], kv.v[layer])


@torch.inference_mode()
def decode_step(model, cache: KVCache, token_id: int, position: int) -> torch.Tensor:
    """One token through every layer, appending its KV; returns fp32 logits ``[vocab]``."""
    pos = torch.tensor([position], device=model.device)
    h, _ = run_layers(model, model.embed(torch.tensor([token_id], device=model.device)), pos, cache)
    return model.logits(h)[0].float()


@torch.inference_mode()
def continuation_nll(model, result: PrefillResult, token_ids) -> list[float]:
    """Per-token NLL of ``token_ids`` continuing a prefilled prompt (teacher forcing, one forward).

    Fidelity metric: how likely a prefill (full, reuse, a blend) makes a given answer, e.g. full
    prefill's greedy answer or the gold one.
    """
    ids = [int(t) for t in token_ids]
    if not ids:
        return []
    n = result.kv.num_tokens
    cache = make_cache(model, capacity=n + len(ids))
    load_prompt(cache, result)
    logps = [torch.log_softmax(result.logits.float(), -1)]
    if len(ids) > 1:
        pos = torch.arange(n, n + len(ids) - 1, device=model.device)
        h, _ = run_layers(model, model.embed(torch.tensor(ids[:-1], device=model.device)), pos, cache)
        logps += list(torch.log_softmax(model.logits(h).float(), -1))
    return [float(-lp[t]) for lp, t in zip(logps, ids, strict=True)]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token: argmax, or temperature / top-k / top-p sampling."""
    if params.temperature < MIN_TEMPERATURE:
        # 0 means greedy; a denormal temperature would overflow the scaled logits into NaN
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if params.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        cut = sp.cumsum(0) - sp > params.top_p
        sp = sp.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter(0, si, sp)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def stream(
    model,
    result: PrefillResult,
    params: SamplingParams | None = None,
    attention: str = "fp16",
    cache: KVCache | None = None,
    **hack_options,
) -> Iterator[TokenEvent]:
    """Yield generated tokens one by one after ``result``'s prefill."""
    params = params or SamplingParams()
    n_prompt = result.kv.num_tokens
    model.check_length(n_prompt, params.max_new_tokens)
    if cache is None:
        cache = make_cache(model, attention, capacity=n_prompt + params.max_new_tokens + 1, **hack_options)
        load_prompt(cache, result)
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    out = Detokenizer(model, params)
    logits = result.logits
    while not out.done:
        tok = sample(logits, params, gen)
        ev, reason = out.accept(tok)
        if ev is not None:
            yield ev
        if reason is not None:
            return
        logits = decode_step(model, cache, tok, n_prompt + ev.index)


def generate(
    model,
    result: PrefillResult,
    params: SamplingParams | None = None,
    attention: str = "fp16",
    **hack_options,
) -> Generation:
    """Generate to completion; ``timings`` has decode time and time per output token."""
    params = params or SamplingParams()
    t0 = time.perf_counter()
    ids, parts = [], []
    for ev in stream(model, result, params, attention, **hack_options):
        ids.append(ev.token_id)
        parts.append(ev.text)
    dt = time.perf_counter() - t0
    text = "".join(parts)
    reason = "length" if len(ids) >= params.max_new_tokens else "stop"
    return Generation(text, ids, reason, {"decode_s": dt, "tpot_s": dt / max(1, len(ids) - 1)})
