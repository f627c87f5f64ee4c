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

import torch

from ragkv.blend.core import PrefillResult, PromptKV
from ragkv.blend.kvtree import KVTree, TreeMatch
from ragkv.model.forward import exact_forward

log = logging.getLogger(__name__)

#: split points the self-check compares against one whole pass: inside the first tile, across a tile
#: boundary, short and long tails (the tile is 128 keys; passes of under 16 rows are padded)
CHECK_SPLITS = (5, 17, 130, 283)
_CHECKED: dict[tuple, bool] = {}
_CHECK_LOCK = threading.Lock()


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
) -> PrefillResult:
    """Prefill ``ids`` exactly, reusing ``tree``'s longest cached prefix (``reuse``) and inserting the
    computed rows (``insert``, nodes ending at ``boundaries``). ``stats``: ``cached_tokens`` (exact rows
    reused), ``computed_tokens``, ``tree_depth`` (nodes matched), ``store_tokens`` (of them, read from the
    store tier), and the row counts every mode reports. ``wait``: block until the new pages are queued
    for the store (ingest) instead of dropping them when the writer is behind (requests).
    ``commit_answer``: the result's ``on_finish(answer, wait=True)`` commits the generated answer's KV
    (:func:`commit`); with ``wait`` it first waits (``tree.persist_wait_s`` at most) for the prompt's
    pages to reach the store (the batching engine does not: other requests share its step)."""
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
    match: TreeMatch | None = tree.match(model, ids, limit) if (tree is not None and reuse) else None
    try:
        m = match.tokens if match is not None else 0
        t_pass = time.perf_counter()
        ep = exact_forward(model, ids, match.parts if m else (), probe_rows=probe_rows)
        seconds = time.perf_counter() - t_pass
        queued: list[str] = []
        if tree is not None:
            tree.cost.observe(n - m, m, seconds)
            if insert:
                queued = tree.insert(model, ids, m, ep.k[:, m:], ep.v[:, m:], boundaries, wait=wait)
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
            if commits:
                commit(model, tree, ids, answer)

        res.on_finish = finish
    return res


def commit(model, tree: KVTree, prompt: Sequence[int], answer: Sequence[int]) -> None:
    """Put the exact KV of ``prompt + answer`` (the prompt already in the tree) into the tree: the next
    turn of a chat, whose prompt repeats both, then computes only what it adds. The answer's rows are
    computed again by an exact pass (decode computes them one at a time, another order)."""
    ids = [int(t) for t in prompt] + [int(t) for t in answer]
    if len(ids) > model.config.max_position or not answer:
        return
    with torch.inference_mode():
        exact_prefill(model, ids, tree, commit_answer=False)
