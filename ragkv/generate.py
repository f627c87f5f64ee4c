"""Token generation after any prefill mode: greedy or sampled, constrained (JSON schema), stop
strings/tokens, log-probabilities, streaming."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ragkv.attention.kvcache import DenseKVCache, KVCache
from ragkv.constrain import ConstraintError, GrammarState, JsonConstraint
from ragkv.defaults import DEFAULT_MAX_NEW_TOKENS, MAX_LOGPROBS, MIN_TEMPERATURE
from ragkv.model.forward import decode_weights_of, decoder, run_layers
from ragkv.model.result import PrefillResult

log = logging.getLogger("ragkv.generate")


@dataclass
class SamplingParams:
    """Decoding settings; ``temperature == 0`` means greedy.

    ``constraint``: the output must be JSON of a schema (:mod:`ragkv.constrain`); it cannot be combined
    with ``stop`` strings (a stop string inside the JSON would cut it). ``logprobs``: None for none,
    ``k`` (0 to :data:`MAX_LOGPROBS`) for each token's log-probability and the ``k`` most likely
    tokens' (the model's log-softmax: before temperature, top-k/top-p and the constraint's mask, as
    OpenAI and vLLM report them).
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS ids
    constraint: JsonConstraint | None = None
    logprobs: int | None = None

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
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.constraint is not None and any(self.stop):
            raise ValueError(
                "stop strings cannot be combined with structured output (they would cut the JSON)"
            )


def request_params(
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    *,
    constraint: JsonConstraint | None = None,
    logprobs: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    default_temperature: float = 0.0,
    eos_token_ids: Sequence[int] = (),
) -> SamplingParams:
    """:class:`SamplingParams` of a request's OpenAI-style fields (None: the default): the one
    conversion every surface uses (service routes, framework wrappers), so they decode alike.

    Temperatures below :data:`MIN_TEMPERATURE` are greedy; ``top_k`` -1 or 0 is off;
    ``stop_token_ids`` stop in addition to ``eos_token_ids`` (vLLM's rule; pass none to replace EOS).
    """
    temperature = default_temperature if temperature is None else temperature
    stop_ids = None
    if stop_token_ids is not None:
        stop_ids = tuple(dict.fromkeys([*eos_token_ids, *stop_token_ids]))
    return SamplingParams(
        max_new_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=temperature if temperature >= MIN_TEMPERATURE else 0.0,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(0, top_k or 0),
        seed=seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_token_ids=stop_ids,
        constraint=constraint,
        logprobs=logprobs,
    )


@dataclass
class TokenEvent:
    """One step of a generation's output: a token and the text it releases, or the closing event.

    ``text`` may be empty (mid multi-byte character, or held back because it may start a stop
    string) or hold text of earlier tokens released now. ``finish_reason`` ("stop" | "length") is set
    on a stream's last event only. ``token_id`` is None on a closing event that adds no token: the
    stream ended on a stop token (or generated none) and the event carries the finish reason and any
    held-back text.
    """

    token_id: int | None
    text: str
    index: int
    finish_reason: str | None = None
    #: with ``SamplingParams.logprobs``, on token events: the token's log-probability and the most
    #: likely tokens' ``(token_id, logprob)``, best first
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None

    @property
    def is_token(self) -> bool:
        """A generated token (not a closing event); what token counts count."""
        return self.token_id is not None


def held_stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string (may start one)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class Detokenizer:
    """One generation's output, token by token: the token choice, stop tokens, stop strings, incremental text.

    The one sampling and stop/detokenize step of :func:`stream` and of the engine (``Engine._accept``):
    :meth:`step` turns a step's logits into the next token (the constraint's mask, the sampling rule,
    the log-probabilities) and accepts it. :meth:`accept` takes a chosen token and returns the event
    to emit (its text may be empty; a stop token gives a closing event, ``token_id`` None) and the
    finish reason ("stop", "length", or None to go on), which the event carries too.
    No part of a stop string is ever emitted: text that may be the start of one is held back until
    it cannot be (then released) or the generation ends on a stop token or the length (then flushed).
    A token that completes a stop string is kept (as vLLM keeps it); the text ends before the stop
    string. Trailing U+FFFD (an incomplete multi-byte character) is held back the same way.
    """

    def __init__(self, model, params: SamplingParams):
        self.decode = model.decode
        self.max_new_tokens = params.max_new_tokens
        self.stop = tuple(s for s in params.stop if s)
        ids = params.stop_token_ids if params.stop_token_ids is not None else model.config.eos_token_ids
        self.stop_ids = frozenset(ids)
        self.params = params
        self.grammar: GrammarState | None = (
            params.constraint.start(model) if params.constraint is not None else None
        )
        self.ids: list[int] = []
        self.text = ""  # the text emitted so far (the whole output once finished)
        self._full = ""  # decode(ids): emitted text plus what is held back

    @property
    def done(self) -> bool:
        """No more tokens may be generated (``max_new_tokens`` reached)."""
        return len(self.ids) >= self.max_new_tokens

    def step(
        self, logits: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[TokenEvent, str | None]:
        """Choose the next token from ``logits`` and :meth:`accept` it: the constraint's mask (a
        finished JSON value with no stop token to end on ends the generation: "stop"), the sampling
        rule, and the token's log-probabilities on its event."""
        logp = torch.log_softmax(logits.float(), -1) if self.params.logprobs is not None else None
        if self.grammar is not None:
            ok = self.grammar.allowed(self.stop_ids)
            if not bool(ok.any()):
                if not self.grammar.complete:  # e.g. only a stop token (of the request's) would continue
                    raise ConstraintError(
                        "no token can continue the JSON: the only ones the schema allows here are stop tokens"
                    )
                return self._emit(None, self._full, "stop")
            logits = logits.masked_fill(~ok.to(logits.device), float("-inf"))
        tok = sample(logits, self.params, generator)
        ev, reason = self.accept(tok)
        if ev.is_token:
            if self.grammar is not None and reason is None:
                self.grammar.advance(tok)
            if logp is not None:
                ev.logprob, ev.top_logprobs = token_logprobs(logp, tok, self.params.logprobs)
        return ev, reason

    def accept(self, tok: int) -> tuple[TokenEvent, str | None]:
        """``(event, finish reason)`` after sampling ``tok``; the event has the reason too."""
        if tok in self.stop_ids:
            return self._emit(None, self._full, "stop")
        self.ids.append(tok)
        self._full = self.decode(self.ids)
        cut = min((i for i in (self._full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self._full = self._full[:cut]
            return self._emit(tok, self._full, "stop")
        if self.done:
            return self._emit(tok, self._full, "length")
        safe = self._full.rstrip("\ufffd")
        return self._emit(tok, safe[: len(safe) - held_stop_prefix(safe, self.stop)], None)

    def finish_empty(self) -> TokenEvent:
        """The closing event of a generation that may produce no token (``max_new_tokens == 0``)."""
        return self._emit(None, self._full, "length")[0]

    def _emit(self, tok: int | None, upto: str, reason: str | None) -> tuple[TokenEvent, str | None]:
        """The event releasing ``upto`` beyond the text emitted so far."""
        # by position: if decoding changed earlier text (tokenizer clean-up), go on from the same place
        delta = upto[len(self.text) :]
        if reason is not None or len(upto) > len(self.text):
            self.text = upto
        index = len(self.ids) - (tok is not None)
        return TokenEvent(tok, delta, index, reason), reason


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    timings: dict = field(default_factory=dict)


def make_cache(model, attention: str = "fp16", capacity: int = 256, **hack_options) -> KVCache:
    """The decode KV cache for ``attention``: ``"fp16"`` (dense, model dtype) or ``"hack"`` (quantized;
    ``hack_options`` over HACK's defaults, :func:`ragkv.attention.hack_cache.default_config`)."""
    if attention in ("fp16", "dense"):
        return DenseKVCache.for_model(model, capacity)
    if attention == "hack":
        from ragkv.attention.hack_cache import HackKVCache, default_config
        from ragkv.model.rope_energy import key_plans_for

        cfg = default_config(hack_options, model.config.head_dim)
        return HackKVCache.for_model(model, cfg, key_plans=key_plans_for(model, cfg))
    raise ValueError(f"unknown attention {attention!r}; use 'fp16' or 'hack'")


def load_prompt(cache: KVCache, result: PrefillResult) -> None:
    """Write a prefill's KV into a decode cache."""
    kv = result.kv
    if result.temper is not None:
        if not isinstance(cache, DenseKVCache):
            raise ValueError(
                "a prefill with APE tempering decodes on the dense cache only (attention='fp16')"
            )
        cache.temper = result.temper
    for layer in range(kv.k.shape[0]):
        cache.write(layer, kv.positions, kv.k[layer], kv.v[layer])


@torch.inference_mode()
def decode_step(model, cache: KVCache, token_id: int, position: int) -> torch.Tensor:
    """One token through every layer, appending its KV; returns fp32 logits ``[vocab]``. Runs on the
    model's decode weights (:func:`ragkv.model.forward.decoder`)."""
    m = decoder(model)
    pos = torch.tensor([position], device=model.device)
    h, _ = run_layers(m, m.embed(torch.tensor([token_id], device=model.device)), pos, cache)
    return m.logits(h)[0].float()


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


def token_logprobs(logp: torch.Tensor, tok: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``tok``'s log-probability in ``logp`` (a log-softmax) and the ``k`` most likely ``(id, logprob)``."""
    top: tuple[tuple[int, float], ...] = ()
    if k:
        vals, ids = torch.topk(logp, min(k, logp.numel()))
        top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
    return float(logp[tok]), top


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
    """Yield generated tokens one by one after ``result``'s prefill; the last event has the finish reason."""
    params = params or SamplingParams()
    n_prompt = result.kv.num_tokens
    model.check_length(n_prompt, params.max_new_tokens)
    if cache is None and attention not in ("fp16", "dense"):  # built (and its options checked) up front
        cache = make_cache(model, attention, capacity=n_prompt + params.max_new_tokens + 1, **hack_options)
        load_prompt(cache, result)
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    out = Detokenizer(model, params)
    if out.done:
        yield out.finish_empty()
        return
    logits = result.logits
    generated: list[int] = []
    while True:
        ev, reason = out.step(logits, gen)
        if ev.token_id is not None:
            generated.append(ev.token_id)
        yield ev
        if reason is not None:
            if result.on_finish is not None:
                try:  # the answer is whole (and sent): its KV goes to the KV tree for the next turn
                    result.on_finish(generated)
                except Exception as e:  # noqa: BLE001 - a cache that fails never fails the answer
                    log.warning("could not commit the answer's KV: %s", e)
            return
        if cache is None:  # the dense cache is filled after the first token is out (it needs only logits)
            cache = make_cache(
                model, attention, capacity=n_prompt + params.max_new_tokens + 1, **hack_options
            )
            load_prompt(cache, result)
        logits = decode_step(model, cache, ev.token_id, n_prompt + ev.index)


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
    *_, (text, ids, reason) = collect(stream(model, result, params, attention, **hack_options))
    dt = time.perf_counter() - t0
    timings = {
        "decode_s": dt,
        "tpot_s": dt / max(1, len(ids) - 1),
        "decode_weights": decode_weights_of(model),
    }
    return Generation(text, ids, reason, timings)


def collect(events: Iterator[TokenEvent]) -> Iterator[TokenEvent | tuple[str, list[int], str]]:
    """Pass a generation's events through, then one ``(text, token ids, finish reason)``: as soon as the
    closing event is out, before the events' own end, where the decode loop may still commit the answer's
    KV (``PrefillResult.on_finish``). A consumer that iterates on runs that work after it has the answer."""
    parts: list[str] = []
    ids: list[int] = []
    reason = "length"
    summarized = False
    for ev in events:
        if ev.is_token:
            ids.append(ev.token_id)
        parts.append(ev.text)
        reason = ev.finish_reason or reason
        yield ev
        if ev.finish_reason is not None and not summarized:
            summarized = True
            yield "".join(parts), ids, reason
    if not summarized:
        yield "".join(parts), ids, reason
