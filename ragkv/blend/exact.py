"""The exact prefill modes (``full``, ``prefix``) on the KV tree: the longest cached prefix of the prompt's
token ids is reused and the rest computed split-invariantly, so the logits equal full prefill's bit for
bit (:func:`ragkv.model.forward.exact_forward`; docs/EXACT_REUSE.md).

``full`` is the same computation with nothing reused (and nothing inserted): the reference the other
modes are measured against.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragkv.attention.buffers import KV_BUFFERS
from ragkv.blend.core import PrefillResult, PromptKV
from ragkv.blend.kvtree import KVTree, TreeMatch, tree_root
from ragkv.model.forward import exact_forward, exact_pass_rows

log = logging.getLogger(__name__)

#: split points the self-check compares against one whole pass: inside the first tile, across a tile
#: boundary, short and long tails (the tile is 128 keys; passes of under 16 rows are padded)
CHECK_SPLITS = (5, 17, 130, 283)
_CHECKED: dict[tuple, bool] = {}
_CHECK_LOCK = threading.Lock()
#: a kept pass buffer is claimed for at least this many rows in place (fewer cost little to copy, and
#: claiming would take the buffer from the conversation it holds)
KEPT_MIN_ROWS = 64


def exactness_check(model) -> bool:
    """Whether exact passes are split-invariant for ``model`` on this machine: a 300-token prompt
    computed whole and after cached heads of several lengths must give the same logits and K/V bits.
    Split invariance rests on measured properties of this CPU's kernels (ragkv/attention/exact.py); a
    machine where they do not hold gets full prefill on every request (the tree is bypassed, with a
    warning) instead of reuse that is not exact. Once per model and thread count per process (~0.3 s)."""
    memo = (id(model), getattr(model, "fingerprint", ""), torch.get_num_threads())
    with _CHECK_LOCK:
        ok = _CHECKED.get(memo)
        if ok is None:
            ok = _CHECKED[memo] = _split_invariant(model)
            if not ok:
                log.warning(
                    "exact passes are not split-invariant on this machine (%s, %d threads): the KV tree "
                    "is bypassed and every prompt is prefilled whole",
                    torch.backends.cpu.get_cpu_capability(),
                    torch.get_num_threads(),
                )
    return ok


def _split_invariant(model) -> bool:
    g = torch.Generator().manual_seed(52)
    n = min(300, model.config.max_position)
    ids = torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
    with torch.inference_mode():
        whole = exact_forward(model, ids)
        for split in (s for s in CHECK_SPLITS if s < n - 1):
            head = exact_forward(model, ids[:split])
            if not (torch.equal(head.k, whole.k[:, :split]) and torch.equal(head.v, whole.v[:, :split])):
                return False
            rest = exact_forward(model, ids, [(head.k, head.v)])
            if not (torch.equal(rest.logits, whole.logits) and torch.equal(rest.k, whole.k)):
                return False
    return True


@dataclass(frozen=True, eq=False)
class KeptRows:
    """What a kept pass buffer holds (:meth:`ragkv.attention.buffers.BufferPool.keep`): the exact K/V of
    ``ids`` for one model object under one tree root. The next pass over a longer prompt that starts
    with these ids (a chat's next turn) writes after them in place instead of copying its cached prefix
    out of the tree's nodes; the tree still decides what is cached (these rows are bit-identical to its
    nodes', both exact passes over the same ids)."""

    root: str
    model: int
    ids: tuple[int, ...]

    def shared(self, root: str, model: int, ids: tuple[int, ...], limit: int) -> int:
        """Leading ids (at most ``limit``) these rows hold for a pass over ``ids``; 0 for another model."""
        if root != self.root or model != self.model:
            return 0
        limit = min(limit, len(ids), len(self.ids))
        if self.ids[:limit] == ids[:limit]:
            return limit
        lo, hi = 0, limit  # the longest equal prefix (tuple comparison runs in C)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.ids[:mid] == ids[:mid] else (lo, mid - 1)
        return lo


def _claim_kept(
    model, root: str, ids: tuple[int, ...], m: int
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Free pass buffers that hold the first rows of ``ids`` (at most ``m``: what the tree matched; at
    least half of them and :data:`KEPT_MIN_ROWS`), with room for this pass: ``(k, v, rows kept)``, or
    None."""
    cfg = model.config
    shape = (cfg.num_layers, exact_pass_rows(model, len(ids), m), cfg.num_kv_heads, cfg.head_dim)

    def score(tag: object) -> int:  # another conversation's rows (a short shared head) are not taken
        shared = tag.shared(root, id(model), ids, m) if isinstance(tag, KeptRows) else 0
        return shared if shared >= KEPT_MIN_ROWS and 2 * shared >= m else 0

    got = KV_BUFFERS.claim(score, {"k": shape, "v": shape}, model.dtype)
    if got is None:
        return None
    tag, bufs = got
    return bufs["k"], bufs["v"], tag.shared(root, id(model), ids, m)


def exact_prefill(
    model,
    ids: Sequence[int],
    tree: KVTree | None = None,
    boundaries: Sequence[int] = (),
    probe_rows: torch.Tensor | None = None,
    insert: bool = True,
    reuse: bool = True,
    wait: bool = False,
    commit_answer: bool = True,
    kept: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> PrefillResult:
    """Prefill ``ids`` exactly, reusing ``tree``'s longest cached prefix (``reuse``) and inserting the
    computed rows (``insert``, nodes ending at ``boundaries``). ``stats``: ``cached_tokens`` (exact rows
    reused), ``computed_tokens``, ``tree_depth`` (nodes matched), ``store_tokens`` (of them, read from the
    store tier), and the row counts every mode reports. ``wait``: block until the new pages are queued
    for the store (ingest) instead of dropping them when the writer is behind (requests).
    ``commit_answer``: the result's ``on_finish(answer, wait=True)`` commits the generated answer's KV
    (:func:`commit`); with ``wait`` it first waits (``tree.persist_wait_s`` at most) for the prompt's
    pages to reach the store (the batching engine does not: other requests share its step).
    ``kept``: ``(k, v, rows)`` buffers whose first rows hold an earlier exact pass over these ids (the
    prompt's own, when its answer is committed); without it, a free kept buffer is looked for
    (:class:`KeptRows`). Either way the pass appends in place instead of copying the cached prefix."""
    t0 = time.perf_counter()
    ids = [int(t) for t in ids]
    n = len(ids)
    if n == 0:
        raise ValueError("empty prompt: no prefix, chunks or question")
    model.check_length(n)
    if tree is not None and not exactness_check(model):
        tree = None  # reuse would not be exact here: full prefill, nothing reused or inserted
    limit = n - 1  # the last row is always computed: its hidden state gives the first logits
    if probe_rows is not None and probe_rows.numel():
        limit = min(limit, int(probe_rows.min()))
    if tree is not None and reuse:
        tree.wait_commits(model, ids)  # a commit under way of this prompt's next rows (a back-to-back turn)
    match: TreeMatch | None = tree.match(model, ids, limit) if (tree is not None and reuse) else None
    try:
        m = match.tokens if match is not None else 0
        root = tree_root(model) if tree is not None else ""
        if m and kept is None:
            kept = _claim_kept(model, root, tuple(ids), m)
        t_pass = time.perf_counter()
        ep = exact_forward(
            model, ids, match.parts if m else (), probe_rows=probe_rows, buffers=kept if m else None
        )
        seconds = time.perf_counter() - t_pass
        queued: list[str] = []
        if tree is not None:
            tree.cost.observe(n - m, m, seconds)
            if insert:
                queued = tree.insert(model, ids, m, ep.k[:, m:], ep.v[:, m:], boundaries, wait=wait)
                KV_BUFFERS.keep({"k": ep.k, "v": ep.v}, KeptRows(root, id(model), tuple(ids)))
    finally:
        if match is not None:
            tree.release(match)
    L = model.config.num_layers
    stats = {
        "num_tokens": n,
        "num_computed_rows": n - m,
        "num_exact_rows": m,
        "num_reused_rows": 0,
        "recompute_fraction": (n - m) / n,
        "question_pass_rows": 0,
        "recomputed_per_layer": [n - m] * L,
        "cached_tokens": m,
        "computed_tokens": n - m,
        "tree_depth": match.depth if match is not None else 0,
        "store_tokens": match.store_tokens if match is not None else 0,
        "exact": True,
        "t_select_s": 0.0,
        "t_load_wait_s": 0.0,
        "t_prefill_s": time.perf_counter() - t0,
    }
    dev = model.device
    kv = PromptKV(ep.k, ep.v, torch.arange(n, device=dev), torch.tensor(ids, dtype=torch.long, device=dev))
    res = PrefillResult(ep.logits, kv, stats, ep.probes, None)
    commits = tree is not None and insert and commit_answer and tree.commit_answers
    if queued or commits:

        def finish(answer: list[int], wait: bool = True) -> None:
            if wait:
                tree.wait_persisted(queued)  # the prompt's pages in the store before the request ends
            if commits:  # after the prompt's rows, in its own buffers (the decode has its own copy)
                whole_k, whole_v = KV_BUFFERS.whole(ep.k), KV_BUFFERS.whole(ep.v)
                rows = (whole_k, whole_v, n) if whole_k is not None and whole_v is not None else None
                commit(model, tree, ids, answer, rows)

        res.on_finish = finish
    return res


def commit(
    model,
    tree: KVTree,
    prompt: Sequence[int],
    answer: Sequence[int],
    kept: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> None:
    """Put the exact KV of ``prompt + answer`` (the prompt already in the tree) into the tree: the next
    turn of a chat, whose prompt repeats both, then computes only what it adds. The answer's rows are
    computed again by an exact pass (decode computes them one at a time, another order). ``kept``: the
    prompt's pass buffers (:func:`exact_prefill`), appended to in place."""
    ids = [int(t) for t in prompt] + [int(t) for t in answer]
    if len(ids) > model.config.max_position or not answer:
        return
    with torch.inference_mode(), tree.committing(model, ids):
        exact_prefill(model, ids, tree, commit_answer=False, kept=kept)
