"""Span planning: which rows of a prompt are which stored chunk.

* Chunk references (:class:`ChunkRef`: a store key and, when known, a span). The wire formats that
  carry them are parsed by their owners (vLLM's ``kv_transfer_params`` in ``ragkv/remote/wire.py``, read
  by ragkv-server's ``/v1/completions``, ``apps/ragkv_server/openai_compat.py``, and by ragkv-vllm's
  connector); the engine takes a key-only one.
* Chunk spans: where each chunk sits in the prompt's token ids (given, or found by content in one
  linear pass: :func:`find_occurrences`, :func:`locate_chunks`), checked by :func:`check_spans`, and
  planned for a request by :func:`plan_spans` (the one planner and its policy, for the service and
  the vLLM connector alike).

The prefill of such a prompt is the RAG's generator's (:mod:`ragkv.rag.generation`, through the
chunk resolver's ``pieces``), whatever generates.

A paged engine's row plan and block addressing are the vLLM connector's
(``integrations/vllm/ragkv_vllm/rows.py``).
"""

from __future__ import annotations

import bisect
import contextlib
import secrets
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

from ragkv.kv.chunk import CHUNK_CONVENTION_VERSION, chunk_key


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


# ---- the span planner: which references of a request are reused, and where ------------------------
@dataclass
class SpanPlan:
    """A request's chunk references planned against its prompt (:func:`plan_spans`).

    ``hits``: stored chunks reused at their rows; ``misses``: chunks whose rows and key agree but whose
    KV is not stored (computed, and stored if the request asks to save); both in prompt order and
    non-overlapping. ``dropped``: ``(key, why)`` of references not used at all (their rows, if any, are
    prompt text)."""

    hits: list[ChunkSpan]
    misses: list[ChunkSpan]
    dropped: list[tuple[str, str]]

    @property
    def spans(self) -> list[ChunkSpan]:
        """Hits and misses together, in prompt order."""
        return sorted(self.hits + self.misses, key=lambda s: s.start)


def plan_spans(
    prompt_ids: Sequence[int],
    refs: Sequence[ChunkRef],
    store,
    fingerprint: str,
    *,
    strict: bool = True,
    on_drop: Callable[[str, str], None] | None = None,
) -> SpanPlan:
    """The one span planner: where a request's chunk references sit in its prompt, and which are stored.

    The policy, the same for the service's ``/v1/completions`` and the vLLM connector:

    1. At most :data:`MAX_CHUNK_REFS` references (bounded work: each distinct key's header is read
       once, and all key-only references are located in one linear pass).
    2. A reference with a span must lie inside the prompt; its rows are that chunk only if
       ``chunk_key(rows, fingerprint) == key`` (else it is dropped: the rows are prompt text). It is a
       hit when the store's header for the key is this model's (fingerprint and chunk convention)
       with the same tokens, else a miss.
    3. A key-only reference is searched by the tokens its stored header records (headers of another
       model or convention are ignored), after the previous match (:func:`locate_chunks`); one not
       stored or not found is dropped.
    4. Spans may not overlap (checked over every given span, those whose key does not match their
       rows included: a malformed request is refused whatever its keys).

    A reference that breaks 1, 2 (outside the prompt) or 4 is a fault: ``strict`` raises
    :class:`SpanError` (the service refuses the request), otherwise the extra or offending reference
    is dropped and the rest planned (a serving engine that cannot refuse). Every drop is reported to
    ``on_drop(key, why)`` (e.g. a warning) and listed in ``dropped``.
    """
    dropped: list[tuple[str, str]] = []

    def drop(key: str, why: str, fault: bool = False) -> None:
        if fault and strict:
            raise SpanError(why)
        dropped.append((key, why))
        if on_drop is not None:
            on_drop(key, why)

    refs = list(refs)
    if len(refs) > MAX_CHUNK_REFS:
        why = f"{len(refs)} chunk references; at most {MAX_CHUNK_REFS} per request"
        drop("", why + " (the rest are ignored)", fault=True)
        refs = refs[:MAX_CHUNK_REFS]
    headers: dict[str, object] = {}

    def header(key: str):
        if key not in headers:
            check_cancelled()
            h = store.header(key)
            ok = h is not None and h.fingerprint == fingerprint and h.convention == CHUNK_CONVENTION_VERSION
            headers[key] = h if ok else None
        return headers[key]

    n = len(prompt_ids)
    hits: list[ChunkSpan] = []
    misses: list[ChunkSpan] = []
    unmatched: list[ChunkSpan] = []  # given spans whose key is not their rows': prompt text
    loose: list[tuple[int, str, list[int]]] = []
    for i, ref in enumerate(refs):
        if ref.start is None:
            h = header(ref.key)
            if h is None:
                drop(ref.key, f"chunk {ref.key[:16]} is not stored for this model")
            else:
                loose.append((i, ref.key, list(h.token_ids)))
            continue
        span = ChunkSpan(i, ref.key, ref.start, ref.length or 0)
        if span.start < 0 or span.length <= 0 or span.stop > n:
            drop(
                ref.key,
                f"chunk {ref.key[:16]} span [{span.start}, {span.stop}) outside the prompt of {n}",
                True,
            )
            continue
        rows = [int(t) for t in prompt_ids[span.start : span.stop]]
        if chunk_key(rows, fingerprint) != ref.key:
            unmatched.append(span)  # dropped below, after the overlap check
            continue
        h = header(ref.key)
        (hits if h is not None and list(h.token_ids) == rows else misses).append(span)
    if loose:
        starts = locate_chunks(prompt_ids, [t for _, _, t in loose])
        for (i, key, toks), at in zip(loose, starts, strict=True):
            if at is None:
                drop(key, f"chunk {key[:16]} not found in the prompt tokens")
            else:
                hits.append(ChunkSpan(i, key, at, len(toks)))
    kept: list[ChunkSpan] = []
    last: ChunkSpan | None = None  # the previous span, kept or not (overlap is judged on all given)
    text = {id(s) for s in unmatched}
    for s in sorted(hits + misses + unmatched, key=lambda s: s.start):
        if last is not None and s.start < last.stop:
            why = f"chunk spans [{last.start}, {last.stop}) and [{s.start}, {s.stop}) overlap"
            drop(s.key, why, True)
            continue
        last = s
        if id(s) in text:
            drop(s.key, f"chunk key {s.key[:16]} does not match its rows under this model")
        else:
            kept.append(s)
    hit = {id(s) for s in hits}
    return SpanPlan([s for s in kept if id(s) in hit], [s for s in kept if id(s) not in hit], dropped)


def request_spans(
    prompt_ids: Sequence[int], chunks: Sequence[ChunkRef], store, fingerprint: str
) -> list[ChunkSpan]:
    """Where a request's chunks sit in its prompt, in prompt order: :func:`plan_spans` (strict), hits
    and misses together."""
    return plan_spans(prompt_ids, chunks, store, fingerprint).spans


def expect_model(store, model) -> None:
    """Tell ``store`` the KV geometry of ``model``'s blobs, so a stored header that disagrees (other
    layers, heads, head_dim, or more tokens than the context) is refused before anything is loaded."""
    from ragkv.store.blob import KVGeometry

    expect = getattr(store, "expect_geometry", None)
    if expect is not None:
        expect(model.fingerprint, KVGeometry.of(model.config))
