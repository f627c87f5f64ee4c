"""Blending inside a serving engine with a paged KV cache (vLLM), without the engine.

The engine-independent half of ``integrations/vllm``: everything here runs and is tested on CPU.

* Chunk references (:class:`ChunkRef`: a store key and, when known, a span); the wire format that
  carries them (vLLM's ``kv_transfer_params``) is parsed at the edge, in ``integrations/vllm/params.py``.
* Chunk spans: where each chunk sits in the prompt's token ids (given, or found by content).
* Row plan: which prompt rows the engine already holds (``EXACT``: its prefix cache), which come
  from stored chunk KV (``REUSED``: HKVD candidates) and which must be computed (``COMPUTED``); and
  how many rows the connector reports to the engine as loaded.
* Paged addressing: rows -> slots and block ids of a request's block table.
* :func:`blend_rows`: fills rows ``[num_exact, num_rows)`` of a prompt with blended KV (CacheBlend
  HKVD selective recompute) through a :class:`~ragkv.model.forward.LayerModel` (ragkv's own
  :class:`ragkv.model.llama.Model`, or the vLLM adapter in ``integrations/vllm/model_hook.py``).
  It is :func:`ragkv.blend.core.selective_prefill`'s blend (the same :class:`~ragkv.blend.core.BlendKV`
  on the same layer loop) with three differences: the engine's prefix-cache rows arrive with
  *post-RoPE* K (what a paged cache holds) and are used as is; the rows after the last chunk (the
  question) are left to the engine, which is exact because causal attention never lets earlier
  rows see later ones; and the last layer's attention and MLP are skipped (no logits are needed).
  Missed chunks are computed for the store by :func:`ragkv.kv.compute_chunk_kv` on the same model.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import secrets
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from ragkv.blend.core import COMPUTED, EXACT, REUSED, BlendKV, BlendSchedule, blend_layers
from ragkv.kv.chunk import ChunkKV


class SpanError(ValueError):
    """Chunk spans that do not fit the prompt (overlapping, out of range, wrong length)."""


@dataclass(frozen=True)
class ChunkRef:
    """One retrieved chunk of a request: its store key and, when the caller knows it, its span."""

    key: str
    start: int | None = None
    length: int | None = None


# ---- spans ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkSpan:
    """A chunk found in the prompt: rows ``[start, start + length)``; ``index`` is its request order."""

    index: int
    key: str
    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


#: most chunk references one request may carry (``kv_transfer_params``); beyond it a request is refused
MAX_CHUNK_REFS = 256
#: tokens of the anchor n-gram :func:`find_occurrences` looks up at each prompt position
ANCHOR_TOKENS = 8
_HASH_MOD = (1 << 61) - 1
_HASH_BASE = secrets.randbelow(_HASH_MOD - (1 << 20)) + (1 << 20)  # per process: no crafted collisions


class SearchCancelled(RuntimeError):
    """The caller gave up (client gone, server stopping) while chunks were searched or computed."""


_CANCEL: ContextVar[Callable[[], bool] | None] = ContextVar("ragkv_span_cancel", default=None)


@contextlib.contextmanager
def cancel_scope(cancelled: Callable[[], bool]):
    """Within this block (same thread), :func:`prefill_stored_spans` and :func:`find_occurrences`
    raise :class:`SearchCancelled` at their next step once ``cancelled()`` is true."""
    token = _CANCEL.set(cancelled)
    try:
        yield
    finally:
        _CANCEL.reset(token)


def check_cancelled() -> None:
    """Raise :class:`SearchCancelled` if the enclosing :func:`cancel_scope` says so."""
    fn = _CANCEL.get()
    if fn is not None and fn():
        raise SearchCancelled("the request was cancelled")


def _prefix_hashes(ids: Sequence[int]) -> list[int]:
    h = [0] * (len(ids) + 1)
    acc = 0
    for i, t in enumerate(ids):
        acc = (acc * _HASH_BASE + t + 1) % _HASH_MOD
        h[i + 1] = acc
    return h


def find_occurrences(
    prompt_ids: Sequence[int], needles: Sequence[Sequence[int] | None], cancel_every: int = 1 << 14
) -> list[list[int]]:
    """Every start row of each token sequence ``needles[j]`` in ``prompt_ids``, ascending.

    Linear in the prompt: one pass computes prefix hashes (polynomial, mod 2**61 - 1, base drawn per
    process), and at each row the hash of the next ``min(ANCHOR_TOKENS, shortest needle)`` tokens
    is looked up in a dict of the needles' anchors; only on a hit are the candidate needles' whole
    hashes compared (O(1) each, one per distinct needle length under that anchor), and only on a
    hash match are the tokens compared one by one, so a collision is never taken for a match. Cost:
    O(prompt + sum of needles + matches x their length). Equal needles share one search. ``None`` or
    empty needles are never found. Reusable to find stored chunks inside any flat prompt.
    """
    ids = list(prompt_ids)
    out: list[list[int]] = [[] for _ in needles]
    real = [(j, list(t)) for j, t in enumerate(needles) if t]
    tokens_of = dict(real)
    if not real or not ids:
        return out
    q = min(ANCHOR_TOKENS, min(len(t) for _, t in real))
    n = len(ids)
    hp = _prefix_hashes(ids)
    powers: dict[int, int] = {}

    def power(m: int) -> int:
        if m not in powers:
            powers[m] = pow(_HASH_BASE, m, _HASH_MOD)
        return powers[m]

    # anchor hash -> needle length -> whole hash -> needle indices (equal needles share an entry)
    table: dict[int, dict[int, dict[int, list[int]]]] = {}
    for j, t in real:
        if len(t) > n:
            continue
        ht = _prefix_hashes(t)
        table.setdefault(ht[q], {}).setdefault(len(t), {}).setdefault(ht[-1], []).append(j)
    if not table:
        return out
    pq = power(q)
    for i in range(n - q + 1):
        if i % cancel_every == 0:
            check_cancelled()
        anchor = (hp[i + q] - hp[i] * pq) % _HASH_MOD
        by_len = table.get(anchor)
        if by_len is None:
            continue
        for m, by_hash in by_len.items():
            if i + m > n:
                continue
            js = by_hash.get((hp[i + m] - hp[i] * power(m)) % _HASH_MOD)
            if js is None:
                continue
            for j in js:
                if ids[i : i + m] == tokens_of[j]:
                    out[j].append(i)
    return out


def find_subsequence(haystack: Sequence[int], needle: Sequence[int], start: int = 0) -> int | None:
    """First ``i >= start`` with ``haystack[i:i+len(needle)] == needle``, or None (linear time)."""
    if not needle:
        return None
    hits = find_occurrences(list(haystack)[start:], [needle])[0]
    return hits[0] + start if hits else None


def locate_chunks(
    prompt_ids: Sequence[int], chunk_tokens: Sequence[Sequence[int] | None]
) -> list[int | None]:
    """Start row of each chunk in the prompt, searched in request order after the previous match.

    None for a chunk with unknown tokens or not found (its text was tokenized differently in the
    prompt, e.g. merged with a neighbour); it is then simply computed, never guessed. Linear in the
    prompt whatever the number of chunks: distinct token sequences are searched once together
    (:func:`find_occurrences`), then each chunk takes its first occurrence after the previous match.
    """
    distinct: dict[tuple[int, ...], int] = {}
    for toks in chunk_tokens:
        if toks:
            distinct.setdefault(tuple(toks), len(distinct))
    occ = find_occurrences(prompt_ids, [list(t) for t in distinct])
    out: list[int | None] = []
    pos = 0
    for toks in chunk_tokens:
        at = None
        if toks:
            starts = occ[distinct[tuple(toks)]]
            k = bisect.bisect_left(starts, pos)
            at = starts[k] if k < len(starts) else None
        out.append(at)
        if at is not None:
            pos = at + len(toks)
    return out


def check_spans(spans: Sequence[ChunkSpan], prompt_len: int) -> list[ChunkSpan]:
    """Spans sorted by start; :class:`SpanError` if one leaves the prompt or two overlap."""
    ordered = sorted(spans, key=lambda s: s.start)
    for s in ordered:
        if s.start < 0 or s.length <= 0 or s.stop > prompt_len:
            raise SpanError(
                f"chunk {s.key[:16]} span [{s.start}, {s.stop}) outside the prompt of {prompt_len}"
            )
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.start < a.stop:
            raise SpanError(f"chunk spans [{a.start}, {a.stop}) and [{b.start}, {b.stop}) overlap")
    return ordered


# ---- row plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of the prompt taken from rows ``[src_start, ...)`` of a stored chunk."""

    span: ChunkSpan
    start: int
    stop: int
    src_start: int

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


@dataclass
class RowPlan:
    """Rows ``[0, num_rows)`` of one prompt: the engine holds ``[0, num_exact)``; the rest is ours."""

    num_rows: int
    num_exact: int
    pieces: list[Piece]  # REUSED runs, in prompt order
    row_class: torch.Tensor = field(repr=False)  # int8 [num_rows]

    @property
    def num_external(self) -> int:
        """Rows reported to the engine as loaded by the connector."""
        return self.num_rows - self.num_exact

    @property
    def num_reused(self) -> int:
        return sum(p.num_tokens for p in self.pieces)

    def reused_rows(self) -> torch.Tensor:
        return (self.row_class == REUSED).nonzero().flatten()

    def without(self, span_index: int) -> RowPlan:
        """The same plan with chunk ``span_index`` computed instead of reused (its load failed)."""
        rc = self.row_class.clone()
        keep = []
        for p in self.pieces:
            if p.span.index == span_index:
                rc[p.start : p.stop] = COMPUTED
            else:
                keep.append(p)
        return RowPlan(self.num_rows, self.num_exact, keep, rc)


def plan_rows(prompt_len: int, hits: Sequence[ChunkSpan], num_exact: int) -> RowPlan | None:
    """Plan the rows the connector fills for a prompt whose first ``num_exact`` rows the engine holds.

    ``hits`` are the chunks found in the prompt *and* in the store. Rows end at the last hit chunk
    (the engine computes the rest, the question included) and never include the last prompt row
    (the engine must compute at least one row to produce logits). Text between chunks is COMPUTED.
    None when no stored row would be used (nothing to gain: let the engine prefill).
    """
    if prompt_len <= 0 or num_exact < 0:
        raise ValueError(f"bad prompt length {prompt_len} / cached rows {num_exact}")
    spans = check_spans(hits, prompt_len)
    if not spans:
        return None
    end = min(spans[-1].stop, prompt_len - 1)
    if end <= num_exact:
        return None
    rc = torch.full((end,), COMPUTED, dtype=torch.int8)
    rc[: min(num_exact, end)] = EXACT
    pieces = []
    for s in spans:
        lo, hi = max(s.start, num_exact), min(s.stop, end)
        if hi > lo:
            rc[lo:hi] = REUSED
            pieces.append(Piece(s, lo, hi, lo - s.start))
    if not pieces:
        return None
    return RowPlan(end, num_exact, pieces, rc)


# ---- paged addressing -----------------------------------------------------------------------------
def slot_mapping(block_ids: Sequence[int], block_size: int, rows: torch.Tensor) -> torch.Tensor:
    """Cache slot ``block_ids[r // block_size] * block_size + r % block_size`` of each row ``r``."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    rows = torch.as_tensor(rows, dtype=torch.long)
    if rows.numel() and int(rows.max()) >= len(block_ids) * block_size:
        raise SpanError(f"row {int(rows.max())} beyond the {len(block_ids)} blocks allocated to the request")
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    return table[rows // block_size] * block_size + rows % block_size


def blocks_of_rows(block_ids: Sequence[int], block_size: int, start: int, stop: int) -> set[int]:
    """Block ids holding rows ``[start, stop)``."""
    if stop <= start:
        return set()
    return {int(block_ids[b]) for b in range(start // block_size, math.ceil(stop / block_size))}


# ---- the vLLM hook's layer replay ----------------------------------------------------------------
def blend_rows(
    model,
    token_ids: torch.Tensor,
    plan: RowPlan,
    reused_source,
    exact_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None,
    schedule: BlendSchedule | None,
    write: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> dict:
    """Fill rows ``[num_exact, num_rows)`` of every layer with blended KV through ``write``.

    The blend of :func:`ragkv.blend.core.selective_prefill` (one layer loop,
    :func:`ragkv.blend.core.blend_layers`) over a :class:`~ragkv.model.forward.LayerModel`.
    ``reused_source.layer(l)``: pre-RoPE K/V of the REUSED rows in order (closed here).
    ``exact_kv(l)``: post-RoPE K and V of rows ``[0, num_exact)`` (read from the engine's cache).
    ``write(l, rows, k_post, v)`` receives rows ``[num_exact, num_rows)``. ``schedule`` None means
    full reuse (no recompute).
    """
    t0 = time.perf_counter()
    n, n_exact = plan.num_rows, plan.num_exact
    if int(token_ids.numel()) < n:
        raise ValueError(f"{token_ids.numel()} token ids for a plan of {n} rows")
    out_rows = torch.arange(n_exact, n, device=model.device)

    def emit(layer: int, K: torch.Tensor, V: torch.Tensor) -> None:
        write(layer, out_rows, K[n_exact:], V[n_exact:])

    kv = BlendKV(
        model,
        plan.row_class,
        schedule,
        stored=reused_source,
        stored_rows=plan.reused_rows(),
        posted=exact_kv,
        n_posted=n_exact,
        on_layer=emit,
    )
    blend_layers(model, token_ids[:n], plan.row_class, kv, last_layer_attention=False)
    return {
        "num_rows": n,
        "num_exact_rows": n_exact,
        "num_reused_rows": kv.n_reused,
        "num_computed_rows": int((plan.row_class == COMPUTED).sum()),
        "recomputed_per_layer": kv.recomputed,
        "t_blend_s": time.perf_counter() - t0,
        "t_load_wait_s": kv.stats()["t_load_wait_s"],
    }


class PieceSlice:
    """Rows ``[lo, hi)`` of a per-layer KV piece (a stored chunk partly covered by the engine's cache)."""

    def __init__(self, piece, lo: int, hi: int):
        self.piece, self.lo, self.hi = piece, lo, hi

    @property
    def num_tokens(self) -> int:
        return self.hi - self.lo

    @property
    def token_ids(self) -> list[int]:
        ids = self.piece.token_ids
        return [int(t) for t in ids[self.lo : self.hi]]

    @property
    def key(self) -> str | None:
        return getattr(self.piece, "key", None)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.piece.layer_kv(layer)
        if self.lo == 0 and self.hi == k.shape[0]:
            return k, v
        return k[self.lo : self.hi], v[self.lo : self.hi]


# ---- in-process prefill of a prompt whose spans are stored chunks ------------------------------------
@dataclass
class SpanPrefill:
    """What :func:`prefill_stored_spans` did: the prefill result and what happened to each chunk."""

    result: object  # ragkv.blend.core.PrefillResult
    spans: list[ChunkSpan]
    kv_hits: int = 0  # chunks whose stored KV was used
    kv_misses: int = 0  # absent, of another model / text, or not found in the prompt: computed alone
    kv_recomputed_bad: int = 0  # stored KV that failed to load mid-prefill (corrupt, store down)
    computed: list[ChunkKV] = field(default_factory=list)  # KV computed here (to save when asked)

    def stats(self) -> dict:
        return {
            **self.result.stats,
            "kv_hits": self.kv_hits,
            "kv_misses": self.kv_misses,
            "kv_recomputed_bad": self.kv_recomputed_bad,
        }


def request_spans(
    prompt_ids: Sequence[int], chunks: Sequence[ChunkRef], store, fingerprint: str
) -> list[ChunkSpan]:
    """Where a request's chunks sit in its prompt, in prompt order.

    Chunks with ``start``/``length`` are taken as given (:class:`SpanError` if they leave the prompt
    or overlap). Key-only chunks are searched by the token ids their store header records (headers of
    another model are ignored); one that is not stored or not found is left out, i.e. computed.
    Bounded work: more than :data:`MAX_CHUNK_REFS` references is a :class:`SpanError`; each distinct
    key's header is read once and all key-only chunks are located in one linear pass.
    """
    if len(chunks) > MAX_CHUNK_REFS:
        raise SpanError(f"{len(chunks)} chunk references; at most {MAX_CHUNK_REFS} per request")
    given = [ChunkSpan(i, c.key, c.start, c.length) for i, c in enumerate(chunks) if c.start is not None]
    loose = [(i, c.key) for i, c in enumerate(chunks) if c.start is None]
    found: list[ChunkSpan] = []
    if loose:
        known: dict[str, list[int] | None] = {}
        for _, key in loose:
            if key not in known:
                check_cancelled()
                h = store.header(key)
                known[key] = list(h.token_ids) if h is not None and h.fingerprint == fingerprint else None
        toks = [known[key] for _, key in loose]
        for (i, key), at, t in zip(loose, locate_chunks(prompt_ids, toks), toks, strict=True):
            if at is not None:
                found.append(ChunkSpan(i, key, at, len(t)))
    return check_spans(given + found, len(prompt_ids))


def expect_model(store, model) -> None:
    """Tell ``store`` the KV geometry of ``model``'s blobs, so a stored header that disagrees (other
    layers, heads, head_dim, or more tokens than the context) is refused before anything is loaded."""
    from ragkv.store.blob import KVGeometry

    expect = getattr(store, "expect_geometry", None)
    if expect is not None:
        expect(model.fingerprint, KVGeometry.of(model.config))


def prefill_stored_spans(
    resolver,
    prompt_ids: Sequence[int],
    chunks: Sequence[ChunkRef],
    schedule: BlendSchedule | None = None,
    *,
    mode: str = "blend",
    prefix_cache=None,
) -> SpanPrefill:
    """Prefill ``prompt_ids`` in process, taking the rows of ``chunks`` from ``resolver``'s store.

    The in-process counterpart of the vLLM connector, with ragkv's own recovery
    (:class:`ragkv.blend.resolver.ChunkResolver`): a chunk is reused only if its key is
    ``chunk_key(its prompt tokens, model fingerprint)`` and its stored header has that fingerprint and
    those tokens; otherwise, or when a layer fails to load, its KV is computed alone (chunk
    convention) and used instead (listed in ``computed``; nothing is written back here: the caller
    decides, e.g. :meth:`ChunkResolver.save`). Text before, between and after the chunks is
    computed. Inside a :func:`cancel_scope` it stops with :class:`SearchCancelled` between chunks once
    the caller gives up. ``mode`` is "blend" (HKVD with ``schedule``, default :class:`BlendSchedule`)
    or "reuse" (stored KV as is). No chunks: a full prefill.
    """
    from ragkv.blend.locate import Located  # it builds on this module's hashing
    from ragkv.blend.prefill import prefill

    model = resolver.model
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("empty prompt")
    if mode not in ("blend", "reuse"):
        raise ValueError(f"mode must be 'blend' or 'reuse', got {mode!r}")
    if not chunks:
        res = prefill(model, ids, [], [], "full", prefix_cache=prefix_cache)
        return SpanPrefill(res, [])
    expect_model(resolver.store, model)
    spans = request_spans(ids, chunks, resolver.store, model.fingerprint)
    if not spans:  # none of the key-only chunks is in the prompt: nothing to reuse
        res = prefill(model, ids, [], [], "full", prefix_cache=prefix_cache)
        return SpanPrefill(res, [], kv_misses=len(chunks))
    found = [Located(s.key, tuple(ids[s.start : s.stop]), s.start, 0, s.stop - s.start) for s in spans]
    prefix, items, suffix = resolver.pieces(ids, found, write_back=False, check=check_cancelled)
    out = SpanPrefill(None, spans, kv_misses=len(chunks) - items.hits)

    def recompute(_toks: list[int]) -> None:
        check_cancelled()
        out.kv_recomputed_bad += 1

    schedule = (schedule or BlendSchedule()) if mode == "blend" else None
    out.result = resolver.prefill(
        prefix,
        items,
        suffix,
        mode,
        schedule.target_ratio if schedule is not None else 0.0,
        write_back=False,
        on_recompute=recompute,
        schedule=schedule,
        prefix_cache=prefix_cache,
    )
    out.kv_hits, out.computed = items.hits, items.computed
    out.result.stats["num_chunks"] = len(spans)  # text between chunks is not a chunk
    return out
