"""Span planning: which rows of a prompt are which stored chunk.

* Chunk references (:class:`ChunkRef`: a store key and, when known, a span). The wire formats that
  carry them are parsed at the edges (vLLM's ``kv_transfer_params`` in ``ragkv/integrations/vllm/params.py``,
  ``/v1/completions``' ``ragkv.chunks`` in ``ragkv/apps/openai_compat.py``); the engine takes a key-only one.
* Chunk spans: where each chunk sits in the prompt's token ids (given, or found by content in one
  linear pass: :func:`find_occurrences`, :func:`locate_chunks`), checked by :func:`check_spans` and
  gathered for a request by :func:`request_spans`.

The prefill of such a prompt is the RAG's generator's (:mod:`ragkv.rag.generation`, through the
chunk resolver's ``pieces``), whatever generates.

A paged engine's row plan and block addressing are the vLLM connector's (``ragkv/integrations/vllm/rows.py``).
"""

from __future__ import annotations

import bisect
import contextlib
import secrets
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass


class SpanError(ValueError):
    """Chunk spans that do not fit the prompt (overlapping, out of range, wrong length)."""


@dataclass(frozen=True)
class ChunkRef:
    """One retrieved chunk of a request: its store key and, when the caller knows it, its span.

    The engine (:mod:`ragkv.engine.provider`) takes a key-only one: the chunk is already in its store."""

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
    """Within this block (same thread), :func:`request_spans`, :func:`find_occurrences`
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


# ---- in-process prefill of a prompt whose spans are stored chunks ------------------------------------
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
