"""The exact KV tree: every prompt's exact KV, shared by longest token prefix, in RAM and in the store.

One tree per model serves every route (``LLM``, ``RAG``, the engine, the service's chat and completion
routes, the integrations): a request's token ids are matched token by token against the tree, the
matched rows' KV is reused and only the rest is computed (:func:`ragkv.model.forward.exact_forward`,
split-invariant, so the logits are full prefill's bit for bit). Design: docs/EXACT_REUSE.md.

* **RAM tier**: a radix tree over token ids (SGLang's RadixAttention): a node holds a run of tokens and
  their rows' post-RoPE K and V ``[L, n, Hkv, D]`` at fixed positions; nodes split where two prompts
  diverge and where the caller marks a boundary (chunk and message ends), so eviction drops a question
  before the passages it followed.
* **Eviction**: a byte budget; only unpinned leaves go; ``policy="pgdsf"`` (RAGCache: priority = clock +
  hits x recompute seconds saved / bytes, the clock raised to each evicted node's priority; recompute
  seconds from this machine's own passes, :class:`RecomputeCost`) or ``"lru"``.
* **Store tier** (``store``, any :class:`ragkv.store.ChunkStore`: local disk, Redis): the KV of every
  full page of :data:`PAGE_TOKENS` tokens at absolute positions, written once in the background under a
  chained content key (the page's ``fingerprint`` names the tree's root and the previous page's key, so
  its chunk key is a hash of the whole prefix), lossless (``raw`` codec), with the store's digest. A miss
  in RAM probes the store page by page; a hit is verified (digest, chain, tokens, shape) and joins the
  RAM tree. So a restarted process, or another process on the same store, finds the pages. A page
  that fails any check is recomputed, never used.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

log = logging.getLogger("ragkv.blend.kvtree")

#: tokens of a store page (the unit written to and read from the store tier)
PAGE_TOKENS = 32
#: bump when the exact computation changes (tile sizes, padding): older pages then never match
EXACT_VERSION = 3
POLICIES = ("pgdsf", "lru")


_ROOTS: dict[tuple, str] = {}


def tree_root(model) -> str:
    """The identity every key of a model's tree chains from: what the exact KV is a function of (the
    weights' fingerprint, dtype, the exact computation's version, the thread count and CPU kernel level,
    which can change float results) and the tokenizer/template it was made for."""
    memo = (id(model), getattr(model, "fingerprint", ""), torch.get_num_threads())
    root = _ROOTS.get(memo)
    if root is None:
        root = _ROOTS[memo] = _tree_root(model)
    return root


def _tree_root(model) -> str:
    tok = getattr(model, "tokenizer", None)
    template = getattr(tok, "chat_template", None) or ""
    parts = [
        f"ragkv-tree-v{EXACT_VERSION}",
        str(getattr(model, "fingerprint", "")),
        str(getattr(model, "dtype", "")),
        str(torch.get_num_threads()),
        str(torch.backends.cpu.get_cpu_capability()),
        # the GEMM prefill runs on, and the instruction sets oneDNN and MKL were capped at (other bits)
        str(getattr(model, "gemm", "")),
        os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
        hashlib.sha256(template.encode()).hexdigest()[:16],
        str(len(tok)) if tok is not None else "-",
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def page_keys(root: str, ids: Sequence[int], page: int = PAGE_TOKENS) -> list[tuple[str, str]]:
    """``(fingerprint, key)`` of each full page of ``ids``: page ``i``'s fingerprint chains the root and
    page ``i-1``'s key, and its key is :func:`ragkv.kv.chunk.chunk_key` of its tokens under that."""
    from ragkv.kv.chunk import TREE_PAGE_PREFIX, chunk_key

    out = []
    prev = "root"
    for i in range(len(ids) // page):
        fp = f"{TREE_PAGE_PREFIX}{root}:{prev}"
        key = chunk_key([int(t) for t in ids[i * page : (i + 1) * page]], fp)
        out.append((fp, key))
        prev = key
    return out


@dataclass
class PrefixSegment:
    """Cached rows of a prompt head as one KV piece of a blend's source (pre-RoPE K, V ``[L, n, Hkv, D]``)."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[1])

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class RecomputeCost:
    """Seconds to recompute ``n`` rows after ``ctx`` cached ones on this machine: ``a*n + b*n*(ctx+n/2)``
    (the linear layers, then attention), fitted by least squares to the exact passes actually run."""

    def __init__(self, a: float = 2e-3, b: float = 2e-8):
        self.a, self.b = a, b
        self._s = [0.0] * 5  # sums of x1*x1, x1*x2, x2*x2, x1*y, x2*y (decayed)
        self._lock = threading.Lock()

    def observe(self, rows: int, ctx: int, seconds: float) -> None:
        """One pass of ``rows`` computed rows after ``ctx`` cached ones took ``seconds``."""
        x1, x2 = float(rows), float(rows) * (ctx + rows / 2)
        with self._lock:
            s = [v * 0.98 for v in self._s]
            s[0] += x1 * x1
            s[1] += x1 * x2
            s[2] += x2 * x2
            s[3] += x1 * seconds
            s[4] += x2 * seconds
            self._s = s
            det = s[0] * s[2] - s[1] * s[1]
            if det > 1e-9 * max(s[0] * s[2], 1e-30):
                a = (s[3] * s[2] - s[1] * s[4]) / det
                b = (s[0] * s[4] - s[1] * s[3]) / det
                if a > 0 and b >= 0:
                    self.a, self.b = a, b
                    return
            if s[0] > 0:  # one-parameter fit while the pair is ill-conditioned
                self.a = max(s[3] / s[0] - self.b * s[1] / s[0], 1e-6)

    def seconds(self, rows: int, ctx: int) -> float:
        return self.a * rows + self.b * rows * (ctx + rows / 2)


@dataclass(eq=False)
class TreeNode:
    """A run of tokens at positions ``start ..`` and their rows' post-RoPE K and V ``[L, n, Hkv, D]`` (an
    exact prefix never moves: K is kept rotated, as attention reads it)."""

    tokens: list[int]
    k: torch.Tensor | None
    v: torch.Tensor | None
    start: int
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)
    hits: int = 1
    last: float = 0.0
    priority: float = 0.0
    pins: int = 0
    #: the rows came from the store tier (for statistics)
    from_store: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class TreeMatch:
    """The longest cached prefix of a request: ``tokens`` rows, from the nodes of ``path`` (each with the
    number of its tokens used), pinned against eviction until :meth:`KVTree.release`."""

    tokens: int
    path: list[tuple[TreeNode, int]]
    depth: int
    store_tokens: int = 0
    #: the matched rows of each node, taken under the tree's lock when matched (a later split of a node
    #: replaces its tensors; these views keep the rows this match saw)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Post-RoPE K and V ``[L, tokens, Hkv, D]`` of the matched rows (None when nothing matched)."""
        if not self.tokens:
            return None
        ks = [k for k, _ in self.parts]
        vs = [v for _, v in self.parts]
        return (torch.cat(ks, 1), torch.cat(vs, 1)) if len(ks) > 1 else (ks[0], vs[0])

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the matched rows ``[lo, hi)`` (copies), gathered from the nodes that hold them:
        a page of a long path costs its own bytes, not a copy of the whole path (:meth:`kv`)."""
        ks, vs, start = [], [], 0
        for k, v in self.parts:
            stop = start + k.shape[1]
            if stop > lo and start < hi:
                a, b = max(lo, start) - start, min(hi, stop) - start
                ks.append(k[:, a:b])
                vs.append(v[:, a:b])
            start = stop
        if len(ks) == 1:
            return ks[0].clone(), vs[0].clone()
        return torch.cat(ks, 1), torch.cat(vs, 1)

    def piece(self, model) -> PrefixSegment | None:
        """The matched rows as one KV piece of a blend's source (pre-RoPE K: the source rotates it)."""
        kv = self.kv()
        return PrefixSegment(unrotate_rows(model, kv[0]), kv[1]) if kv is not None else None


def unrotate_rows(model, k: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Pre-RoPE K of post-RoPE rows ``[L, n, Hkv, D]`` at positions ``start ..``, for a blend's source
    (which rotates stored rows itself): the inverse rotation, exact up to float rounding."""
    pos = torch.arange(start, start + k.shape[1], device=k.device)
    cos, sin = model.rope_tables(pos)
    half = k.shape[-1] // 2
    rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    # the rotation may carry an attention scale (YaRN): cos^2 + sin^2 is then its square
    return (k * cos - rotated * sin) / (cos * cos + sin * sin)


def tree_store(store):
    """Where a tree over ``store`` keeps its pages: the store's ``tree`` namespace (None: no store, or one
    without namespaces, :meth:`ragkv.store.ChunkStore.sibling`)."""
    sibling = getattr(store, "sibling", None)
    return sibling("tree") if sibling is not None else None


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor that holds only its own rows (a copy when it is a view into a larger buffer)."""
    whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


class KVTree:
    """The exact KV tree of one model (see the module doc). Thread-safe."""

    def __init__(
        self,
        max_bytes: int = 1 << 30,
        store=None,
        policy: str = "pgdsf",
        page_tokens: int = PAGE_TOKENS,
        write_queue: int = 256,
        commit_answers: bool = True,
        persist_wait_s: float = 2.0,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; use one of {POLICIES}")
        if page_tokens < 1:
            raise ValueError("page_tokens must be >= 1")
        self.max_bytes = int(max_bytes)
        self.store = store
        self.policy = policy
        self.page_tokens = page_tokens
        #: commit each finished answer's KV (an exact pass over prompt + answer after the answer is sent:
        #: the next chat turn then computes only what it adds; a single-shot workload pays that pass)
        self.commit_answers = commit_answers
        #: at a request's end, how long it waits for its prompt's pages to reach the store (0: never),
        #: so that another process on the store, or this one after a restart, finds them
        self.persist_wait_s = float(persist_wait_s)
        self.cost = RecomputeCost()
        self._roots: dict[str, TreeNode] = {}
        self._lock = threading.RLock()
        self._bytes = 0
        self._clock = 0.0
        self._tick = 0
        self._persisted: dict[str, None] = {}  # page keys known to be in the store (bounded, insertion order)
        self._queue: queue.Queue | None = None
        self._pending: set[str] = set()  # page keys queued and not yet written (or failed)
        self._written = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self._write_queue = write_queue
        #: answers being committed now: ``id(event) -> (root, ids, event)``, the event set when done (:meth:`committing`)
        self._commits: dict[int, tuple[str, tuple[int, ...], threading.Event]] = {}
        #: how long a request waits for a commit under way that holds its next rows (:meth:`wait_commits`)
        self.commit_wait_s = 2.0
        self.counters = dict.fromkeys(
            "requests hit_requests tokens_requested tokens_matched store_tokens store_pages_read "
            "store_pages_written store_pages_rejected store_errors evictions evicted_bytes".split(),
            0,
        )

    # ---- lookup -----------------------------------------------------------------------------------
    def match(self, model, ids: Sequence[int], limit: int | None = None) -> TreeMatch:
        """The longest cached prefix of ``ids`` (at most ``limit`` tokens), pinned; RAM first, then the
        store's pages beyond it (joined to the RAM tree). Release it with :meth:`release`."""
        ids = [int(t) for t in ids]
        limit = len(ids) if limit is None else min(limit, len(ids))
        root = tree_root(model)
        m = self._match_ram(root, ids, limit, touch=False)
        self.release(m)
        store_tokens = 0
        if self.store is not None and m.tokens + self.page_tokens <= limit:
            store_tokens = self._load_pages(model, root, ids, m.tokens, limit)
        m = self._match_ram(root, ids, limit)
        m.store_tokens = min(store_tokens, m.tokens)
        with self._lock:
            c = self.counters
            c["requests"] += 1
            c["hit_requests"] += bool(m.tokens)
            c["tokens_requested"] += len(ids)
            c["tokens_matched"] += m.tokens
            c["store_tokens"] += m.store_tokens
        return m

    @contextlib.contextmanager
    def committing(self, model, ids: Sequence[int]) -> Iterator[None]:
        """Mark the exact pass that inserts ``ids`` (a chat answer's commit) as under way, so that a
        request whose prompt extends ``ids`` waits for it (:meth:`wait_commits`) instead of computing the
        same rows beside it: a turn sent back to back on another worker."""
        event = threading.Event()
        with self._lock:
            self._commits[id(event)] = (tree_root(model), tuple(int(t) for t in ids), event)
        try:
            yield
        finally:
            with self._lock:
                self._commits.pop(id(event), None)
            event.set()

    def wait_commits(self, model, ids: Sequence[int], timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``, default :attr:`commit_wait_s`) for the commits under way whose ids
        ``ids`` starts with and that hold more of them than the RAM tier does now; whether any was waited
        for. The exact rows come out the same either way: this saves computing them twice, side by side."""
        if not self._commits:
            return False
        root = tree_root(model)
        ids = tuple(int(t) for t in ids)
        with self._lock:
            found = [
                (len(c), ev)
                for r, c, ev in self._commits.values()
                if r == root and len(c) < len(ids) and ids[: len(c)] == c
            ]
        if not found:
            return False
        have = self.peek(model, ids)
        events = [ev for n, ev in found if n > have]
        if not events:
            return False
        deadline = time.monotonic() + (self.commit_wait_s if timeout is None else timeout)
        for ev in events:
            ev.wait(max(0.0, deadline - time.monotonic()))
        return True

    def peek(self, model, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` the RAM tier holds now (no pin, no statistics): what a
        scheduler orders waiting requests by."""
        m = self._match_ram(tree_root(model), [int(t) for t in ids], len(ids), touch=False)
        self.release(m)
        return m.tokens

    def _match_ram(self, root: str, ids: list[int], limit: int, touch: bool = True) -> TreeMatch:
        with self._lock:
            node = self._roots.get(root)
            path: list[tuple[TreeNode, int]] = []
            pos = 0
            self._tick += 1
            while node is not None and pos < limit:
                child = node.children.get(ids[pos])
                if child is None:
                    break
                n = 0
                stop = min(len(child.tokens), limit - pos)
                while n < stop and child.tokens[n] == ids[pos + n]:
                    n += 1
                if n == 0:
                    break
                path.append((child, n))
                pos += n
                if n < len(child.tokens):
                    break
                node = child
            parts = [(nd.k[:, :used], nd.v[:, :used]) for nd, used in path]
            for nd, _ in path:
                nd.pins += 1
                if touch:
                    nd.hits += 1
                    nd.last = self._tick
                    self._refresh(nd)
            return TreeMatch(pos, path, len(path), parts=parts)

    def release(self, match: TreeMatch) -> None:
        """Unpin a match's nodes."""
        with self._lock:
            for nd, _ in match.path:
                nd.pins = max(0, nd.pins - 1)
            match.path = []

    # ---- insert -----------------------------------------------------------------------------------
    def insert(
        self,
        model,
        ids: Sequence[int],
        first: int,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        boundaries: Sequence[int] = (),
        persist: bool = True,
        wait: bool = False,
    ) -> list[str]:
        """Add the rows ``[first, len(ids))`` of an exact pass over ``ids`` (post-RoPE ``k_new``, ``v_new``
        ``[L, len(ids) - first, Hkv, D]``) after the prefix ``ids[:first]``, which must still be in the
        tree (the caller's match keeps it pinned). ``boundaries``: absolute positions where a node must
        end (chunk and message ends). Then evicts down to the budget and queues the new full pages for
        the store (``wait``: blocking while the writer's queue is full, else such pages are skipped).
        Returns the keys of the pages queued (:meth:`wait_persisted` waits for them)."""
        ids = [int(t) for t in ids]
        n = len(ids)
        if first >= n:
            return []
        root = tree_root(model)
        with self._lock:
            rootnode = self._roots.get(root)
            if rootnode is None:
                rootnode = self._roots[root] = TreeNode([], None, None, 0)
            node, pos = self._descend(rootnode, ids, first)
            if pos < first:
                log.debug("kv tree: prefix of %d tokens gone before insert (%d left)", first, pos)
                return []
            if pos >= n:  # another request inserted the same rows meanwhile
                return []
            cuts = sorted({b for b in boundaries if pos < b < n} | {n})
            start = pos
            for cut in cuts:
                toks = ids[start:cut]
                k = k_new[:, start - first : cut - first]
                v = v_new[:, start - first : cut - first]
                child = TreeNode(toks, _own(k), _own(v), start, parent=node, last=self._tick)
                node.children[toks[0]] = child
                self._bytes += child.nbytes()
                self._refresh(child)
                node, start = child, cut
            self._evict()
        if persist and self.store is not None:
            return self._queue_pages(model, root, ids, wait)
        return []

    def _descend(self, rootnode: TreeNode, ids: list[int], first: int) -> tuple[TreeNode, int]:
        """``(node, pos)``: the deepest node whose tokens ``ids`` follow, ``pos`` tokens matched (rows
        beyond ``first`` may exist already: another request inserted them). A node is split only where
        ``ids`` diverge from it inside it; a prompt that ends inside a node matches to its end."""
        node, pos = rootnode, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n, stop = 0, min(len(child.tokens), len(ids) - pos)
            while n < stop and child.tokens[n] == ids[pos + n]:
                n += 1
            if n < len(child.tokens):
                if pos + n == len(ids):  # ids end inside this node: all of them are there
                    return child, len(ids)
                if n == 0:
                    break
                self._split(child, n)
            node, pos = child, pos + n
        return node, pos

    def _split(self, node: TreeNode, n: int) -> None:
        """Cut ``node`` after its first ``n`` tokens (the rest becomes its only child)."""
        tail = TreeNode(
            node.tokens[n:],
            node.k[:, n:].clone(),
            node.v[:, n:].clone(),
            node.start + n,
            parent=node,
            children=node.children,
            hits=node.hits,
            last=node.last,
            pins=0,
            from_store=node.from_store,
        )
        for c in tail.children.values():
            c.parent = tail
        node.tokens = node.tokens[:n]
        node.k = node.k[:, :n].clone()
        node.v = node.v[:, :n].clone()
        node.children = {tail.tokens[0]: tail}
        self._refresh(node)
        self._refresh(tail)

    # ---- eviction ---------------------------------------------------------------------------------
    def _node_cost(self, node: TreeNode) -> float:
        return self.cost.seconds(len(node.tokens), node.start)

    def _refresh(self, node: TreeNode) -> None:
        if self.policy == "lru":
            node.priority = node.last
        else:
            node.priority = self._clock + node.hits * self._node_cost(node) / max(node.nbytes(), 1)

    def _leaves(self):
        stack = list(self._roots.values())
        while stack:
            nd = stack.pop()
            if nd.children:
                stack.extend(nd.children.values())
            elif nd.parent is not None:
                yield nd

    def _evict(self) -> None:
        while self._bytes > self.max_bytes:
            victim = min(
                (nd for nd in self._leaves() if nd.pins == 0), key=lambda nd: nd.priority, default=None
            )
            if victim is None:
                return  # every leaf is in use: over budget until they are released
            self._remove(victim)

    def _remove(self, node: TreeNode) -> None:
        parent = node.parent
        if parent is not None and parent.children.get(node.tokens[0]) is node:
            del parent.children[node.tokens[0]]
        self._bytes -= node.nbytes()
        self.counters["evictions"] += 1
        self.counters["evicted_bytes"] += node.nbytes()
        if self.policy == "pgdsf":
            self._clock = max(self._clock, node.priority)
        node.k = node.v = None

    def clear(self) -> None:
        """Drop every RAM node (the store's pages stay)."""
        with self._lock:
            self._roots.clear()
            self._bytes = 0

    # ---- store tier -------------------------------------------------------------------------------
    def _load_pages(self, model, root: str, ids: list[int], have: int, limit: int) -> int:
        """Join the store's pages that extend the RAM match (``have`` tokens) into the tree; how many
        tokens beyond ``have`` they cover."""
        from ragkv.store.base import BlobError

        P = self.page_tokens
        keys = page_keys(root, ids[: (limit // P) * P], P)
        first_page = have // P
        got_k, got_v = [], []
        cfg = model.config
        want = (cfg.num_layers, P, cfg.num_kv_heads, cfg.head_dim)
        for i in range(first_page, len(keys)):
            fp, key = keys[i]
            try:
                ch = self.store.get(key, fp, device=model.device, dtype=model.dtype)
            except (BlobError, ValueError, OSError) as e:
                ch = None
                self._count("store_errors")
                log.warning("kv tree: store page %s unusable (%s); recomputing", key[:16], e)
            if ch is None:
                break
            ok = (
                ch.token_ids.tolist() == ids[i * P : (i + 1) * P]
                and int(ch.start_pos) == i * P
                and tuple(ch.k.shape) == want
                and tuple(ch.v.shape) == want
                and bool(torch.isfinite(ch.k).all())
                and bool(torch.isfinite(ch.v).all())
            )
            if not ok:
                self._count("store_pages_rejected")
                log.warning("kv tree: store page %s does not hold this prefix; recomputing", key[:16])
                with self._lock:
                    self._persisted.pop(key, None)
                break
            got_k.append(ch.k)
            got_v.append(ch.v)
            self._count("store_pages_read")
            self._mark_persisted(key)
        if not got_k:
            return 0
        start = first_page * P
        end = start + len(got_k) * P
        k = torch.cat(got_k, 1)
        v = torch.cat(got_v, 1)
        # the pages overlap the RAM match by ``have - start`` rows: insert from where RAM stops
        m = self._match_ram(root, ids, have, touch=False)
        try:
            if m.tokens >= start:
                off = m.tokens - start
                self.insert(model, ids[:end], m.tokens, k[:, off:], v[:, off:], persist=False)
                self._mark_from_store(root, ids, m.tokens, end)
        finally:
            self.release(m)
        return end - max(have, start)

    def _mark_from_store(self, root: str, ids: list[int], lo: int, hi: int) -> None:
        with self._lock:
            node = self._roots.get(root)
            pos = 0
            while node is not None and pos < hi:
                child = node.children.get(ids[pos]) if pos < len(ids) else None
                if child is None:
                    break
                if child.start >= lo:
                    child.from_store = True
                pos = child.end
                node = child

    def _mark_persisted(self, key: str) -> None:
        with self._lock:
            self._persisted[key] = None
            while len(self._persisted) > 65536:
                self._persisted.pop(next(iter(self._persisted)))

    def _queue_pages(self, model, root: str, ids: list[int], wait: bool = False) -> list[str]:
        """Queue the full pages of ``ids`` not yet known to be in the store (their rows read from RAM now);
        the keys queued."""
        P = self.page_tokens
        keys = page_keys(root, ids, P)
        todo = [i for i, (_, key) in enumerate(keys) if key not in self._persisted]
        queued: list[str] = []
        if not todo:
            return queued
        m = self._match_ram(root, ids, len(keys) * P, touch=False)
        try:
            for i in todo:
                if (i + 1) * P > m.tokens:
                    break
                fp, key = keys[i]
                self._mark_persisted(key)  # queued once; a failed write forgets it again
                item = (fp, key, ids[i * P : (i + 1) * P], i * P, *m.rows(i * P, (i + 1) * P))
                if self._enqueue(item, wait):
                    queued.append(key)
        finally:
            self.release(m)
        return queued

    def _enqueue(self, item, wait: bool = False) -> bool:
        """Queue a page for the writer (started on demand). Under the lock, so the writer cannot decide
        to stop between the check and the put; a full queue skips the page (False), or waits with
        ``wait``."""
        deadline = time.monotonic() + 60.0
        while True:
            with self._lock:
                if self._writer is None or not self._writer.is_alive():
                    self._queue = queue.Queue(self._write_queue)
                    self._writer = threading.Thread(
                        target=self._write_loop, args=(self._queue,), name="ragkv-kvtree-writer", daemon=True
                    )
                    self._writer.start()
                try:
                    self._queue.put_nowait(item)
                    self._pending.add(item[1])
                    return True
                except queue.Full:
                    if not wait or time.monotonic() > deadline:
                        self._persisted.pop(item[1], None)
                        return False
            time.sleep(0.01)

    def _write_loop(self, q: queue.Queue) -> None:
        from ragkv.kv.chunk import ChunkKV
        from ragkv.store import blob as blobfmt
        from ragkv.store.codecs import get_codec

        raw = get_codec("raw")
        try:  # the writer only uses idle CPU: answering comes first (Linux: per-thread nice)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            try:
                item = q.get(timeout=30.0)
            except queue.Empty:
                with self._lock:  # idle: stop, unless a page arrived meanwhile (queued under this lock)
                    if q.empty():
                        self._writer = None
                        return
                continue
            fp, key, toks, start, k, v = item
            try:
                ch = ChunkKV(
                    torch.tensor(toks, dtype=torch.long),
                    k,
                    v,
                    start,
                    fp,
                    meta={"kind": "tree-page", "k": "post-rope"},
                )
                blob = blobfmt.encode_chunk(ch, raw, self.store.auth)
                ok = self.store.put_blob(key, blob)
            except Exception as e:  # a store that fails must never break answering
                ok = False
                log.warning("kv tree: writing page %s failed: %s", key[:16], e)
            with self._lock:
                self.counters["store_pages_written" if ok else "store_errors"] += 1
                if not ok:
                    self._persisted.pop(key, None)
                self._pending.discard(key)
                self._written.notify_all()
            q.task_done()

    def wait_persisted(self, keys: Sequence[str], timeout: float | None = None) -> bool:
        """Wait until the pages ``keys`` (as :meth:`insert` returned them) are written or failed: True,
        or False after ``timeout`` (default :attr:`persist_wait_s`). A request calls it as it ends, so a
        second process on the store finds its prompt; meanwhile the writer has the CPU it waits with."""
        timeout = self.persist_wait_s if timeout is None else timeout
        keys = [k for k in keys if k]
        if not keys or timeout <= 0:
            return not keys
        deadline = time.monotonic() + timeout
        with self._written:
            while any(k in self._pending for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._written.wait(left)
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued page is written (True) or ``timeout`` passes (False)."""
        q = self._queue
        if q is None:
            return True
        deadline = time.monotonic() + timeout
        while q.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not q.unfinished_tasks

    # ---- statistics -------------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        with self._lock:
            count, stack = 0, list(self._roots.values())
            while stack:
                nd = stack.pop()
                stack.extend(nd.children.values())
                count += nd.parent is not None
            return count

    def stats(self) -> dict:
        """Counters, RAM bytes and nodes, token hit rate, the fitted recompute cost."""
        with self._lock:
            c = dict(self.counters)
        c.update(
            ram_bytes=self._bytes,
            ram_nodes=len(self),
            max_bytes=self.max_bytes,
            policy=self.policy,
            token_hit_rate=c["tokens_matched"] / c["tokens_requested"] if c["tokens_requested"] else 0.0,
            recompute_s_per_row=self.cost.a,
        )
        return c


#: the name of :class:`KVTree` before the tree (ragkv 0.1's per-process prefix cache), kept for callers
PrefixCache = KVTree
