"""Stored chunks found inside any flat prompt (transparent reuse).

A framework that formats retrieved documents its own way (LangChain's ``"\\n\\n".join(...)``,
LlamaIndex's context template) hands ragkv one flat prompt. :class:`ChunkLocator` finds the stored
chunks inside it in one linear pass: it keeps, per stored chunk, the hash of ``ANCHOR_TOKENS`` tokens
just inside its start (``margin`` tokens in, because the first tokens of a chunk often tokenize
differently next to the text before it) and, for a chunk long enough, of as many just inside its
end (a document's first word split in several tokens, ``"iss" "u" "ance"``, is one token ``"
issuance"`` after a space: deeper than the margin), rolls that hash over the prompt, verifies every
hit token by token and extends it both ways as far as the tokens agree. Overlapping matches (a
near-copy of a passage matches part of another's rows) are resolved to the set covering the most
rows. A match is a
slice ``[lo, hi)`` of the chunk's rows: the boundary tokens that tokenized differently stay outside
it and are computed as fresh rows by the blend. Built once (O(chunks)) and then kept in step with the corpus by
:meth:`ChunkLocator.add` / :meth:`ChunkLocator.remove` (O(changed chunks)), so a prompt with no
stored chunk costs one rolling hash over its tokens and an ingest never rebuilds it.

Locating stays linear in the prompt however many chunks are stored: an anchor window is shared by
at most :data:`MAX_BUCKET` chunks. Chunks that begin (or end) alike, e.g. documents under the same
boilerplate header, take the nearest window inward that is still distinctive, so a prompt position
is verified against a bounded number of chunks. :attr:`ChunkLocator.counts` counts that work
(probes, anchor hits, tokens compared): the cost model a test checks by counting instead of timing.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ragkv.blend.spans import _HASH_BASE, _HASH_MOD, ANCHOR_TOKENS, check_cancelled

#: most chunks anchored at one window hash; a chunk whose window is that common anchors further in
MAX_BUCKET = 4


@dataclass
class LocateCounts:
    """Work of :meth:`ChunkLocator.find` calls so far: the cost model in numbers, not seconds.

    ``probes``: prompt positions whose rolling hash was looked up (one per position: linear in the
    prompt, whatever the number of stored chunks); ``hits``: anchors found there and verified;
    ``compared``: prompt tokens compared while verifying and extending those hits (a match counts its
    tokens plus 2, the comparisons that may have ended it). Updated once per call and per hit (no cost
    per position); approximate while finds run in several threads at once.
    """

    probes: int = 0
    hits: int = 0
    compared: int = 0


@dataclass(frozen=True)
class Located:
    """Prompt rows ``[start, start + hi - lo)`` are rows ``[lo, hi)`` of the stored chunk ``key``."""

    key: str
    token_ids: tuple[int, ...]  # the whole chunk's tokens
    start: int
    lo: int
    hi: int

    @property
    def stop(self) -> int:
        return self.start + self.hi - self.lo


def append_chunks(ids: list[int], chunks: Iterable[tuple[str, Sequence[int]]]) -> list[Located]:
    """Append each whole chunk ``(key, token ids)`` to ``ids`` and say where it went (a prompt built
    from explicit chunks: retrieved records, a framework's chunk list)."""
    out = []
    for key, toks in chunks:
        toks = tuple(int(t) for t in toks)
        out.append(Located(key, toks, len(ids), 0, len(toks)))
        ids += toks
    return out


def split_at_chunks(
    prompt_ids: Sequence[int], found: Sequence[Located]
) -> tuple[list[int], list[list[int] | Located], list[int]]:
    """``prompt_ids`` as ``(prefix, pieces, suffix)`` around the non-overlapping chunks ``found`` (in
    prompt order): each chunk as its :class:`Located`, the text between chunks as token-id lists.

    The one prompt splitter: a job's token-id parts (:meth:`ragkv.rag.generation.PromptJob.parts`) and
    the resolver's prefill items (:meth:`ragkv.blend.resolver.ChunkResolver.pieces`) both come from it."""
    ids = [int(t) for t in prompt_ids]
    if not found:
        return ids, [], []
    pieces: list[list[int] | Located] = []
    pos = found[0].start
    for f in found:
        if f.start > pos:
            pieces.append(ids[pos : f.start])
        pieces.append(f)
        pos = f.stop
    return ids[: found[0].start], pieces, ids[pos:]


def _hash(ids: Sequence[int]) -> int:
    acc = 0
    for t in ids:
        acc = (acc * _HASH_BASE + t + 1) % _HASH_MOD
    return acc


class ChunkLocator:
    """Finds stored chunks (``(key, token ids)``) inside prompts; see the module docstring.

    ``margin``: tokens skipped at each end of a chunk before its anchor; ``min_share``: the least
    share of a chunk's tokens a match must cover to be reused (a short accidental overlap is not).
    """

    def __init__(self, chunks: Iterable[tuple[str, Sequence[int]]], margin: int = 2, min_share: float = 0.5):
        self.margin, self.min_share = margin, min_share
        #: anchor hash -> the (key, tokens, anchor offset) anchored there; a bucket is replaced, never
        #: mutated, so a :meth:`find` running in another thread sees the old or the new bucket, whole
        self._anchors: dict[int, tuple[tuple[str, tuple[int, ...], int], ...]] = {}
        self._hash_of: dict[str, tuple[int, ...]] = {}  # key -> its anchors' hashes (one per key)
        self._lead = pow(_HASH_BASE, ANCHOR_TOKENS - 1, _HASH_MOD)  # the leaving token's weight
        self.counts = LocateCounts()  # the work of every find so far (tests count it)
        self.add(chunks)

    @property
    def num_chunks(self) -> int:
        """Distinct stored chunks this locator can find."""
        return len(self._hash_of)

    def add(self, chunks: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Make ``(key, token ids)`` chunks findable (a key already known, or too short, is skipped)."""
        for key, toks in chunks:
            if key in self._hash_of:
                continue
            toks = tuple(int(t) for t in toks)
            hashes = []
            for a, h in self._distinct_anchors(toks):
                self._anchors[h] = (*self._anchors.get(h, ()), (key, toks, a))
                hashes.append(h)
            if hashes:
                self._hash_of[key] = tuple(hashes)

    def _distinct_anchors(self, toks: tuple[int, ...]) -> list[tuple[int, int]]:
        """``(offset, hash)`` of a chunk's anchors: at :meth:`_anchors_at`'s offsets, or where that
        window already anchors :data:`MAX_BUCKET` chunks, the nearest window inward (towards the
        chunk's middle) that anchors fewer; if none does, the least shared one. O(1) hashes unless
        the chunk's usual windows are that common, O(chunk tokens) then."""
        n, q = len(toks), ANCHOR_TOKENS
        rolled: list[int] = []

        def window(a: int) -> int:
            if not rolled:  # every window's hash, rolled, once a usual window was too common
                rolled.append(_hash(toks[:q]))
                for i in range(n - q):
                    h = ((rolled[-1] - (toks[i] + 1) * self._lead) * _HASH_BASE + toks[i + q] + 1) % _HASH_MOD
                    rolled.append(h)
            return rolled[a]

        def load(h: int) -> int:
            return len(self._anchors.get(h, ()))

        mid = (n - q) // 2
        out: list[tuple[int, int]] = []
        for k, a in enumerate(self._anchors_at(n)):
            h = _hash(toks[a : a + q])
            if load(h) >= MAX_BUCKET:
                inward = range(a, mid + 1) if k == 0 else range(a, min(mid, a) - 1, -1)
                a = next(
                    (b for b in inward if load(window(b)) < MAX_BUCKET),
                    min(inward, key=lambda b: load(window(b)), default=a),
                )
                h = window(a)
            if all(a != b for b, _ in out):
                out.append((a, h))
        return out

    def remove(self, keys: Iterable[str]) -> None:
        """Forget the chunks with these keys (KV no indexed chunk references any more)."""
        for key in keys:
            for h in dict.fromkeys(self._hash_of.pop(key, ())):
                rest = tuple(e for e in self._anchors.get(h, ()) if e[0] != key)
                if rest:
                    self._anchors[h] = rest
                else:
                    self._anchors.pop(h, None)

    def _anchors_at(self, n: int) -> tuple[int, ...]:
        """Where a chunk of ``n`` tokens is anchored: ``margin`` tokens in from its start and, when
        the two do not overlap, from its end (none: too short to locate reliably)."""
        if n < ANCHOR_TOKENS:
            return ()
        first = min(self.margin, n - ANCHOR_TOKENS)
        last = n - self.margin - ANCHOR_TOKENS
        return (first, last) if last >= first + ANCHOR_TOKENS else (first,)

    def find(
        self,
        prompt_ids: Sequence[int],
        visible: Callable[[str], bool] | None = None,
    ) -> list[Located]:
        """Non-overlapping stored chunks in ``prompt_ids``, in prompt order.

        Every match is found first (each anchor hit verified and extended as far as the tokens
        agree), then the non-overlapping set covering the most rows is taken (:meth:`_disjoint`).
        So a near-copy of a passage that matches part of a chunk's rows (MuSiQue's distractors)
        never takes them from the chunk that matches them all, wherever in the prompt either match
        was found. ``visible``: only chunks whose key it
        accepts are candidates, so a hidden chunk never takes a visible one's rows (asked once per
        matching key and call). The call's work is added to :attr:`counts`."""
        ids = [int(t) for t in prompt_ids]
        seen: dict[str, bool] = {}

        def shown(key: str) -> bool:
            if visible is None:
                return True
            if key not in seen:
                seen[key] = bool(visible(key))
            return seen[key]

        n, q = len(ids), ANCHOR_TOKENS
        if n < q or not self._anchors:
            return []
        found: list[Located] = []
        searched_to: dict[str, int] = {}  # per key: rows before this are inside its last match
        self.counts.probes += n - q + 1
        h = _hash(ids[:q])
        for i in range(n - q + 1):
            if i % (1 << 14) == 0:
                check_cancelled()
            for key, toks, a in self._anchors.get(h, ()):
                if i < searched_to.get(key, 0) or not shown(key):
                    continue  # its match here, if any, is the one already found (its other anchor)
                self.counts.hits += 1
                m = self._match(ids, i, toks, a)
                if m is not None:
                    found.append(Located(key, toks, *m))
                    searched_to[key] = m[0] + m[2] - m[1]
            if i + q < n:
                h = ((h - (ids[i] + 1) * self._lead) * _HASH_BASE + ids[i + q] + 1) % _HASH_MOD
        return self._disjoint(found)

    def _disjoint(self, found: list[Located]) -> list[Located]:
        """Non-overlapping matches from ``found``: the set of whole matches covering the most rows
        (weighted interval scheduling; of equal cover, the shorter chunks: the ones it covers most
        of), then each other match trimmed to its longest run of rows still free, kept if that run
        is ``min_share`` of its chunk (a chunk whose start a longer match took keeps its tail)."""
        cands = sorted(found, key=lambda f: (f.stop, f.start))
        stops = [f.stop for f in cands]
        best: list[tuple[int, int]] = [(0, 0)]  # best[j]: (rows, -chunk tokens) of cands[:j]
        prev: list[int] = []
        for j, f in enumerate(cands):
            p = bisect.bisect_right(stops, f.start, 0, j)  # cands[:p] end before f starts
            prev.append(p)
            with_f = (best[p][0] + f.hi - f.lo, best[p][1] - len(f.token_ids))
            best.append(max(best[j], with_f))
        chosen, j = set(), len(cands)
        while j > 0:
            f, p = cands[j - 1], prev[j - 1]
            if (best[p][0] + f.hi - f.lo, best[p][1] - len(f.token_ids)) > best[j - 1]:
                chosen.add(j - 1)
                j = p
            else:
                j -= 1
        out = [cands[j] for j in sorted(chosen)]
        taken = [(f.start, f.stop) for f in out]
        rest = sorted(
            (f for j, f in enumerate(cands) if j not in chosen),
            key=lambda f: (f.lo - f.hi, len(f.token_ids), f.start),
        )
        for f in rest:
            start, stop = _longest_free(taken, f.start, f.stop)
            if stop - start < self.min_share * len(f.token_ids):
                continue
            lo = f.lo + start - f.start
            out.append(Located(f.key, f.token_ids, start, lo, lo + stop - start))
            bisect.insort(taken, (start, stop))
        return sorted(out, key=lambda f: f.start)

    def _match(self, ids: list[int], at: int, toks: tuple[int, ...], a: int) -> tuple[int, int, int] | None:
        """``(prompt start, lo, hi)`` of chunk ``toks`` whose anchor at offset ``a`` is at prompt row
        ``at``, or None."""
        if ids[at : at + ANCHOR_TOKENS] != list(toks[a : a + ANCHOR_TOKENS]):
            self.counts.compared += ANCHOR_TOKENS
            return None  # a hash collision, never taken for a match
        hi = a + ANCHOR_TOKENS
        while hi < len(toks) and at + hi - a < len(ids) and ids[at + hi - a] == toks[hi]:
            hi += 1
        lo = a
        while lo > 0 and at - (a - lo) - 1 >= 0 and ids[at - (a - lo) - 1] == toks[lo - 1]:
            lo -= 1
        self.counts.compared += hi - lo + 2  # the matched tokens, and the two that may have ended it
        if hi - lo < self.min_share * len(toks):
            return None
        return at - (a - lo), lo, hi


def _longest_free(taken: list[tuple[int, int]], start: int, stop: int) -> tuple[int, int]:
    """The longest run of ``[start, stop)`` that no interval of ``taken`` (sorted, disjoint) covers
    (the first of equally long ones; ``(start, start)`` if none is free)."""
    best, pos = (start, start), start
    k = max(0, bisect.bisect_right(taken, (start, start)) - 1)
    for a, b in taken[k:]:
        if a >= stop:
            break
        if a > pos and a - pos > best[1] - best[0]:
            best = (pos, a)
        pos = max(pos, b)
    if stop > pos and stop - pos > best[1] - best[0]:
        best = (pos, stop)
    return best
