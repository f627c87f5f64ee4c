"""Paged KV: the block pool, a per-sequence ``KVCache`` over block tables, and batched decode.

The pool holds ``num_blocks`` physical blocks of ``block_size`` rows ``[Hkv, D]`` for K and V. A
block belongs to one layer of one or more sequences; each sequence keeps one block table per layer
(BFF/CFF may fuse different blocks in different layers) and, per table entry, the norms ``n_K, n_V``
that rescale a fused representative for this member (1.0 for an ordinary block). Rows sit at
positions ``0 .. length-1`` in table order. With ``attention="hack"`` the pool holds no fp16 blocks:
:class:`~ragkv.engine.hack_blocks.HackPages` keeps quantized pages plus bounded fp16 staging, and
sequences and decode steps go through ``hack_seq``.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable

import torch

from ragkv.attention.dense import layer_windows
from ragkv.attention.kvcache import KVCache, cache_geometry
from ragkv.attention.paged import decode_mask, paged_attention
from ragkv.engine.block_manager import BlockManager
from ragkv.fusion.norm_attention import norm_aware_attention, paged_norm_attention
from ragkv.model.forward import run_layers


class PagedCacheError(ValueError):
    """Bad use of a paged sequence (non-contiguous positions, wrong shapes, layer out of range)."""


class KVPool:
    """Physical K/V blocks ``[num_blocks, block_size, Hkv, D]`` plus the allocator that owns them."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        sliding_window: int | None | tuple[int | None, ...] = None,
        hack_config=None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        #: per layer: its sliding window (None: full causal)
        self.windows = layer_windows(sliding_window, num_layers)
        self.device = torch.device(device)
        self.hack = None
        if hack_config is not None:
            from ragkv.engine.hack_blocks import HackPages

            dtype = torch.float16  # HACK keeps its unquantized rows in fp16, as HackKVCache does
            self.hack = HackPages(
                num_blocks, block_size, num_layers, num_kv_heads, head_dim, hack_config, self.device
            )
        self.dtype = dtype
        shape = (0 if self.hack else num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)  # HACK: empty (no fp16 blocks)
        self.v = torch.zeros_like(self.k)
        self.manager = BlockManager(num_blocks)
        self.row_bytes = num_kv_heads * head_dim * self.k.element_size()  # one row of K (or V)

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16, hack_config=None) -> KVPool:
        return cls(
            num_blocks, block_size, **cache_geometry(model), dtype=model.dtype, hack_config=hack_config
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: dense K and V, or one HACK page."""
        if self.hack is not None:
            return self.hack.page_bytes
        return 2 * self.block_size * self.row_bytes

    def nbytes(self) -> int:
        """Physical bytes of the pool's KV storage (HACK: pages, staging capacity, smoothing stats)."""
        if self.hack is not None:
            return self.hack.nbytes()
        return self.k.nbytes + self.v.nbytes

    def free(self, block: int) -> None:
        """Drop one reference (a freed HACK page is simply overwritten when next sealed)."""
        self.manager.free(block)

    def read_blocks(self, phys: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of blocks ``phys`` of ``layer``: ``[n, bs, Hkv, D]`` (HACK: dequantized sealed pages)."""
        if self.hack is None:
            return self.k[phys], self.v[phys]
        return self.hack.read_blocks(phys, torch.full_like(phys, layer))

    def write_blocks(self, phys: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite whole blocks ``phys`` of ``layer`` with ``k, v [n, bs, Hkv, D]`` (HACK: quantized)."""
        if self.hack is None:
            self.k[phys] = k.to(self.dtype)
            self.v[phys] = v.to(self.dtype)
            return
        self.hack.write_blocks(
            phys, torch.full_like(phys, layer), k, v, torch.zeros_like(phys, dtype=torch.bool)
        )


def block_keys(
    token_ids: list[int], block_size: int, num_blocks: int, salt: str, num_exact: int | None = None
) -> list[str]:
    """Chained content hashes of the first ``num_blocks`` full blocks (vLLM-style prefix keys).

    Each row's provenance is hashed with its token: rows ``>= num_exact`` (default: none) hold
    approximate KV (reused chunk KV, or rows that attended to it), so a block holding such rows
    never has the key of a block of exactly computed rows with the same tokens.
    """
    n_exact = len(token_ids) if num_exact is None else num_exact
    h = hashlib.sha256(f"ragkv-block|{salt}|".encode())
    out = []
    for j in range(num_blocks):
        lo, hi = j * block_size, (j + 1) * block_size
        h.update(torch.tensor(token_ids[lo:hi], dtype=torch.int64).numpy().tobytes())
        h.update(bytes(int(r >= n_exact) for r in range(lo, hi)))
        out.append(h.copy().hexdigest())
    return out


class PagedSequence(KVCache):
    """One sequence's KV in the pool: per-layer block tables and per-entry fusion norms."""

    def __init__(self, pool: KVPool, on_alloc: Callable[[int], None] | None = None):
        self.pool = pool
        self.num_layers = pool.num_layers
        self.tables: list[list[int]] = [[] for _ in range(self.num_layers)]
        self.k_norm: list[list[float]] = [[] for _ in range(self.num_layers)]
        self.v_norm: list[list[float]] = [[] for _ in range(self.num_layers)]
        self._len = [0] * self.num_layers
        self.on_alloc = on_alloc
        self.allocated = 0  # blocks this sequence took from the free list (for reservations)
        self.hack_state = None
        if pool.hack is not None:
            from ragkv.engine.hack_seq import HackSeqState

            self.hack_state = HackSeqState()
        #: per layer, the table entries that are fused members (never fused again)
        self.fused: list[set[int]] = [set() for _ in range(self.num_layers)]
        self._fused_cache: dict[int, tuple] = {}
        self.released = False

    # ---- allocation ------------------------------------------------------------------------------
    def _new_block(self, layer: int) -> int:
        (b,) = self.pool.manager.allocate(1)
        self.allocated += 1
        if self.on_alloc is not None:
            self.on_alloc(1)
        self.tables[layer].append(b)
        self.k_norm[layer].append(1.0)
        self.v_norm[layer].append(1.0)
        return b

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise PagedCacheError(f"layer {layer} out of range [0, {self.num_layers})")
        if self.released:
            raise PagedCacheError("sequence already released")

    # ---- KVCache ---------------------------------------------------------------------------------
    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append rows at the next positions of ``layer`` (paged rows are contiguous from 0).

        HACK pools take rows through :meth:`load_prompt` and :func:`batched_decode_step` only (their
        state is per sequence, all layers alike).
        """
        self._check_layer(layer)
        if self.pool.hack is not None:
            raise PagedCacheError("HACK pages are written by load_prompt and batched_decode_step")
        n = int(k.shape[0])
        start = self._len[layer]
        want = torch.arange(start, start + n)
        if positions.numel() != n or not torch.equal(positions.cpu().long(), want):
            raise PagedCacheError(f"paged rows must be appended at positions {start}..{start + n - 1}")
        if k.shape != v.shape or tuple(k.shape[1:]) != (self.pool.num_kv_heads, self.pool.head_dim):
            raise PagedCacheError(f"k and v must be [n, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
        bs = self.pool.block_size
        row = 0
        while row < n:
            pos = start + row
            j, s = divmod(pos, bs)
            b = self.tables[layer][j] if j < len(self.tables[layer]) else self._new_block(layer)
            take = min(bs - s, n - row)
            self.pool.k[b, s : s + take] = k[row : row + take].to(self.pool.dtype)
            self.pool.v[b, s : s + take] = v[row : row + take].to(self.pool.dtype)
            row += take
        self._len[layer] = start + n

    def attend(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        self._check_layer(layer)
        n = self._len[layer]
        if n == 0:
            raise PagedCacheError(f"attend on layer {layer} before any row was written")
        p = self.pool
        table = self.tables[layer]
        if p.hack is not None:
            from ragkv.engine.hack_seq import attend_one

            return attend_one(self, layer, q, q_pos)
        idx = torch.tensor(table, dtype=torch.long, device=p.device)
        k_pos = torch.arange(len(table) * p.block_size, device=p.device)
        k_pos = torch.where(k_pos < n, k_pos, torch.full_like(k_pos, -1))
        return norm_aware_attention(
            q,
            p.k[idx],
            p.v[idx],
            torch.tensor(self.k_norm[layer]),
            torch.tensor(self.v_norm[layer]),
            q_pos.to(p.device),
            k_pos,
            p.scale,
            p.windows[layer],
        )

    @property
    def length(self) -> int:
        return self._len[-1]

    def layer_length(self, layer: int) -> int:
        return self._len[layer]

    def nbytes(self) -> int:
        """Bytes of the blocks this sequence references, each shared block split among its holders
        (HACK: plus its fp16 staging and sink slots)."""
        total = 0.0
        mgr = self.pool.manager
        for layer in range(self.num_layers):
            for b in self.tables[layer]:
                total += self.pool.block_bytes / mgr.ref_count(b)
        hp = self.pool.hack
        if hp is not None:
            total += len(self.hack_state.open) * hp.stage.slot_bytes
            if hp.sinks is not None:
                total += hp.sinks.slot_bytes
        return int(total)

    # ---- prompt loading, sealing, release ----------------------------------------------------------
    def load_prompt(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        keys: list[str] | None = None,
    ) -> int:
        """Write a prefill's post-RoPE ``k, v [L, N, Hkv, D]``; returns blocks shared instead of stored.

        ``keys[j]`` (optional) is the content key of full block ``j`` for blocks whose KV depends on the
        prompt head only; such blocks are shared with any live sequence that registered the same key.
        """
        if any(self._len):
            raise PagedCacheError("load_prompt on a sequence that already has rows")
        L, n = int(k.shape[0]), int(k.shape[1])
        if L != self.num_layers:
            raise PagedCacheError(f"prompt KV has {L} layers, the pool {self.num_layers}")
        bs, mgr = self.pool.block_size, self.pool.manager
        keys = keys or []
        if self.pool.hack is not None:
            from ragkv.engine import hack_seq

            return hack_seq.load_prompt(self, k, v, keys)
        shared = 0
        for layer in range(L):
            j = self.adopt_shared(layer, keys, n // bs)
            shared += j
            self._len[layer] = j * bs
            pos = torch.arange(j * bs, n)
            self.write(layer, pos, k[layer, j * bs :], v[layer, j * bs :])
            for jj in range(j, min(len(keys), n // bs)):
                mgr.register((keys[jj], layer), self.tables[layer][jj])
        return shared

    def adopt_shared(self, layer: int, keys: list[str], limit: int) -> int:
        """Append the registered blocks of ``keys[:limit]`` to ``layer``'s table (a shared prefix), up to
        the first one not registered; returns how many were adopted."""
        mgr, j = self.pool.manager, 0
        while j < min(len(keys), limit):
            b = mgr.lookup((keys[j], layer))
            if b is None:
                break
            mgr.incref(b)
            self.tables[layer].append(b)
            self.k_norm[layer].append(1.0)
            self.v_norm[layer].append(1.0)
            j += 1
        return j

    def fused_norms(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(table indices, n_K, n_V) of the fused entries of ``layer``, cached until more are fused."""
        cached = self._fused_cache.get(layer)
        if cached is None or cached[0] != len(self.fused[layer]):
            js = sorted(self.fused[layer])
            cached = (
                len(js),
                torch.tensor(js, dtype=torch.long),
                torch.tensor([self.k_norm[layer][j] for j in js]),
                torch.tensor([self.v_norm[layer][j] for j in js]),
            )
            self._fused_cache[layer] = cached
        return cached[1], cached[2], cached[3]

    def full_blocks(self, layer: int) -> int:
        return self._len[layer] // self.pool.block_size

    def fusable_blocks(self, layer: int) -> int:
        """Leading blocks BFF/CFF may fuse: full ones (HACK: sealed ones, quantized in their pages)."""
        if self.hack_state is not None:
            return self.hack_state.sealed
        return self.full_blocks(layer)

    def references(self) -> Counter:
        """How many times this sequence references each physical block (all layers)."""
        return Counter(b for t in self.tables for b in t)

    def release(self) -> None:
        """Drop every block reference (idempotent)."""
        if self.released:
            return
        if self.hack_state is not None:
            from ragkv.engine.hack_seq import release

            release(self)
        for layer in range(self.num_layers):
            for b in self.tables[layer]:
                self.pool.free(b)
            self.tables[layer] = []
            self.k_norm[layer] = []
            self.v_norm[layer] = []
        self.released = True


class PagedBatchKV:
    """The K/V of one decode step of a batch of paged sequences (a ``LayerKV`` for ``run_layers``).

    Each new row is written into its sequence's current block and attention is one padded,
    norm-aware batch over the block tables (masks per distinct window, built once per step). HACK
    pools use :class:`ragkv.engine.hack_seq.HackStep` instead (same batching over quantized pages).
    """

    def __init__(self, seqs: list[PagedSequence], positions: list[int], device):
        self.seqs, self.pool = seqs, seqs[0].pool
        pool, bs = self.pool, self.pool.block_size
        self.pos_list = positions
        self.lengths = torch.tensor(positions, dtype=torch.long, device=device) + 1
        for s, p in zip(seqs, positions, strict=True):  # a fresh block wherever a sequence crosses into one
            if p % bs == 0:
                for layer in range(s.num_layers):
                    if p // bs == len(s.tables[layer]):
                        s._new_block(layer)
        nb = max(len(t) for s in seqs for t in s.tables)
        self.nb = nb
        self.masks = {w: decode_mask(self.lengths, nb * bs, w) for w in set(pool.windows)}
        self.slots = torch.tensor([p % bs for p in positions], dtype=torch.long, device=device)
        self.blocks = (self.lengths - 1) // bs
        self.device = device
        self._tables: torch.Tensor | None = None

    def write(self, layer, positions, k, v) -> None:
        pool = self.pool
        rows = [s.tables[layer] + [0] * (self.nb - len(s.tables[layer])) for s in self.seqs]
        self._tables = torch.tensor(rows, dtype=torch.long, device=self.device)
        cur = self._tables.gather(1, self.blocks[:, None]).squeeze(1)
        pool.k[cur, self.slots] = k.to(pool.dtype)
        pool.v[cur, self.slots] = v.to(pool.dtype)

    def attend(self, layer, q, q_pos) -> torch.Tensor:
        pool = self.pool
        fused = None
        if any(s.fused[layer] for s in self.seqs):
            parts = [(i, *s.fused_norms(layer)) for i, s in enumerate(self.seqs) if s.fused[layer]]
            dev = self.device
            fused = (
                torch.cat([torch.full_like(j, i) for i, j, _, _ in parts]).to(dev),
                torch.cat([j for _, j, _, _ in parts]).to(dev),
                torch.cat([kn for _, _, kn, _ in parts]).to(dev),
                torch.cat([vn for _, _, _, vn in parts]).to(dev),
            )
        mask = self.masks[pool.windows[layer]]
        if fused is None:  # plain paged attention; fusion only where a sequence holds fused blocks
            return paged_attention(q, pool.k, pool.v, self._tables, self.lengths, pool.scale, mask=mask)
        return paged_norm_attention(
            q, pool.k, pool.v, self._tables, None, None, self.lengths, pool.scale, mask=mask, fused=fused
        )

    def finish(self) -> None:
        """Every layer of every sequence now holds its new row."""
        for s, p in zip(self.seqs, self.pos_list, strict=True):
            s._len = [p + 1] * s.num_layers


@torch.inference_mode()
def batched_decode_step(model, seqs: list[PagedSequence], token_ids: list[int]) -> torch.Tensor:
    """One token per sequence through every layer, appending its KV; returns fp32 logits ``[B, vocab]``.

    Rows run stacked through the projections and MLP (:func:`ragkv.model.forward.run_layers`); RoPE
    is applied at each sequence's own position; attention is one padded batch over the block tables
    (norm-aware; :class:`PagedBatchKV`), or one HACK batch over quantized pages
    (:class:`~ragkv.engine.hack_seq.HackStep`). Greedy tokens match
    :func:`ragkv.generate.decode_step` on each sequence alone.
    """
    if not seqs:
        raise ValueError("batched_decode_step needs at least one sequence")
    dev = model.device
    pos_list = [s.length for s in seqs]
    if seqs[0].pool.hack is not None:
        from ragkv.engine.hack_seq import HackStep

        kv = HackStep(seqs, pos_list)
    else:
        kv = PagedBatchKV(seqs, pos_list, dev)
    pos = torch.tensor(pos_list, dtype=torch.long, device=dev)
    h, _ = run_layers(model, model.embed(torch.tensor(token_ids, dtype=torch.long, device=dev)), pos, kv)
    kv.finish()
    return model.logits(h).float()
