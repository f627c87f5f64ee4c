"""Paged KV: the block pool, a sequence's block tables (a ``KVCache``), and the batched decode step.

A block is ``block_size`` rows ``[Hkv, D]`` of K and V of one layer, held by one or more sequences.
A sequence's tables are one tensor ``table [L, nb]`` (BFF/CFF may fuse different blocks per layer),
with per-entry norms ``[2, L, nb]`` that rescale a fused representative for this member (1 otherwise).
Tables live across steps; a decode step stacks the batch's once (:func:`batch_tables`). Where blocks
live and how rows are written and read is the pool's :class:`~ragkv.engine.backend.KVBackend`:
:class:`DenseBlocks` (the default), or HACK's quantized pages (``ragkv.attention.hack_seq.HackKV``).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter

import torch

from ragkv.attention.dense import layer_windows
from ragkv.attention.kvcache import KVCache, cache_geometry
from ragkv.attention.paged import batch_tables, decode_mask, paged_attention
from ragkv.engine.backend import KVBackend
from ragkv.engine.block_manager import BlockManager
from ragkv.fusion.norm_attention import norm_aware_attention, paged_norm_attention
from ragkv.model import lowbit_kernel
from ragkv.model.forward import decoder, run_layers
from ragkv.model.rope_energy import key_plans_for


class PagedCacheError(ValueError):
    """Bad use of a paged sequence (non-contiguous positions, wrong shapes, a released sequence)."""


class DenseBlocks:
    """The default KV backend: blocks ``[num_blocks, block_size, Hkv, D]`` of K and V in the model's dtype."""

    staged = False  # nothing beside the blocks: the allocator's peak is the KV peak
    scaled_representatives = False  # a fused representative is stored as the unit direction

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device):
        self.dtype, self.block_size = dtype, block_size
        self.k = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.block_bytes = self.bytes_per_block(block_size, num_kv_heads, head_dim, dtype)

    @staticmethod
    def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def staging_bytes_in_use(self) -> int:
        return 0

    def sealed_rows(self, num_tokens: int) -> int:
        return num_tokens

    def put(self, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows ``k, v [..., Hkv, D]`` into row ``offsets`` of ``blocks`` (same leading shape)."""
        self.k[blocks, offsets] = k.to(self.dtype)
        self.v[blocks, offsets] = v.to(self.dtype)

    def read_blocks(self, phys: torch.Tensor, layers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[phys], self.v[phys]

    def write_blocks(self, phys, layers, k: torch.Tensor, v: torch.Tensor, first) -> None:
        self.k[phys], self.v[phys] = k.to(self.dtype), v.to(self.dtype)

    def new_state(self) -> None:
        return None

    def load_prompt(self, seq: PagedSequence, k: torch.Tensor, v: torch.Tensor, js: list[int]) -> None:
        """One scatter of every row that is not in a shared block (layer ``l``'s first ``js[l]``)."""
        pool, (L, n) = seq.pool, k.shape[:2]
        rows = torch.arange(n, device=pool.device)
        own = rows[None] >= torch.tensor(js, device=pool.device)[:, None] * self.block_size
        blk, off = seq.table[:, rows // self.block_size], (rows % self.block_size).expand(L, n)
        k, v = k.to(pool.device), v.to(pool.device)
        if bool(own.all()):
            self.put(blk, off, k, v)
        else:
            self.put(blk[own], off[own], k[own], v[own])

    def attend(self, seq: PagedSequence, layer: int, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        p, idx = seq.pool, seq.table[layer]
        k_pos = torch.arange(idx.numel() * p.block_size, device=p.device)
        k_pos = torch.where(k_pos < seq._len[layer], k_pos, -1)
        kn, vn = seq.norms[:, layer]
        return norm_aware_attention(
            q, self.k[idx], self.v[idx], kn, vn, q_pos.to(p.device), k_pos, p.scale, p.windows[layer]
        )

    def seq_bytes(self, seq: PagedSequence) -> int:
        return 0

    def fusable_blocks(self, seq: PagedSequence, layer: int) -> int:
        """Full blocks."""
        return seq._len[layer] // self.block_size

    def release(self, seq: PagedSequence) -> None:
        pass

    def decode_kv(self, seqs, pos: torch.Tensor, tables: torch.Tensor, norms) -> PagedBatchKV:
        return PagedBatchKV(seqs, pos, tables, norms)


class KVPool:
    """Physical KV blocks (its :attr:`backend`'s) plus the allocator that owns them."""

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
        key_plans=None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size, self.num_layers, self.scale = block_size, num_layers, scale
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.windows = layer_windows(sliding_window, num_layers)  # per layer (None: full causal)
        self.device = torch.device(device)
        self.backend: KVBackend
        #: HACK's backend (its pages, staging and smoothing statistics) when ``hack_config`` is given
        self.hack = None
        if hack_config is not None:
            from ragkv.attention.hack_seq import HackKV

            self.backend = self.hack = HackKV(
                num_blocks,
                block_size,
                num_layers,
                num_kv_heads,
                head_dim,
                hack_config,
                self.device,
                key_plans,
            )
        else:
            self.backend = DenseBlocks(num_blocks, block_size, num_kv_heads, head_dim, dtype, self.device)
        self.dtype = self.backend.dtype
        self.manager = BlockManager(num_blocks)

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16, hack_config=None) -> KVPool:
        """A pool of ``model``'s geometry; a ``k_plan="rope"`` HACK config gets the model's key plans."""
        plans = key_plans_for(model, hack_config, paged=True) if hack_config is not None else None
        return cls(
            num_blocks,
            block_size,
            **cache_geometry(model),
            dtype=model.dtype,
            hack_config=hack_config,
            key_plans=plans,
        )

    @staticmethod
    def block_bytes_for(model, block_size: int, hack_config=None) -> int:
        """Bytes of one block of ``model``'s pool: dense K and V, or one HACK page."""
        c = model.config
        if hack_config is None:
            return DenseBlocks.bytes_per_block(block_size, c.num_kv_heads, c.head_dim, model.dtype)
        from ragkv.attention.hack_seq import HackKV

        return HackKV.page_bytes_for(hack_config, block_size, c.num_kv_heads, c.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: dense K and V, or one HACK page."""
        return self.backend.block_bytes

    def nbytes(self) -> int:
        """Physical bytes of the pool's KV storage (HACK: pages, staging capacity, smoothing stats)."""
        return self.backend.nbytes()

    def read_blocks(self, phys: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of blocks ``phys`` of ``layer``: ``[n, bs, Hkv, D]`` (HACK: dequantized sealed pages)."""
        return self.backend.read_blocks(phys, torch.full_like(phys, layer))

    def write_blocks(self, phys: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite whole blocks ``phys`` of ``layer`` with ``k, v [n, bs, Hkv, D]`` (HACK: quantized)."""
        self.backend.write_blocks(phys, torch.full_like(phys, layer), k, v, torch.zeros_like(phys).bool())

    def sealed_blocks(self, num_tokens: int) -> int:
        """Leading blocks of a ``num_tokens``-row sequence that are final (HACK: quantized, sealed)."""
        return self.backend.sealed_rows(num_tokens) // self.block_size

    def shared_blocks(self, keys: list[str], num_tokens: int) -> list[list[int]]:
        """Per layer, the live blocks registered under ``keys`` (a shared prompt head) up to the first
        miss, among the blocks a ``num_tokens``-row prompt seals."""
        out = []
        for layer in range(self.num_layers):
            got = []
            for key in keys[: self.sealed_blocks(num_tokens)]:
                b = self.manager.lookup((key, layer))
                if b is None:
                    break
                got.append(b)
            out.append(got)
        return out


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
    """One sequence's KV in the pool: block tables ``[L, nb]`` and fusion norms ``[2, L, nb]`` (tensors)."""

    def __init__(self, pool: KVPool):
        self.pool, self.num_layers = pool, pool.num_layers
        self.table = torch.zeros(pool.num_layers, 0, dtype=torch.long, device=pool.device)
        self.norms = torch.ones(2, pool.num_layers, 0, device=pool.device)
        self.fused: list[set[int]] = [set() for _ in range(self.num_layers)]  # never fused again
        self._len = [0] * self.num_layers
        self.state = pool.backend.new_state()  # the backend's per-sequence state (dense: None)
        self.released = False

    @property
    def num_blocks(self) -> int:
        """Table entries per layer."""
        return self.table.shape[1]

    def _append(self, blocks: torch.Tensor) -> None:
        self.table = torch.cat([self.table, blocks.to(self.pool.device)], 1)
        self.norms = torch.cat([self.norms, self.norms.new_ones(2, self.num_layers, blocks.shape[1])], 2)

    def grow(self) -> None:
        """Append a fresh block to every layer's table (the next row starts a block)."""
        self._append(torch.tensor(self.pool.manager.allocate(self.num_layers))[:, None])

    # ---- KVCache ---------------------------------------------------------------------------------
    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append rows at the next positions of ``layer`` (dense pools only: other backends' rows enter
        through :meth:`load_prompt` and :func:`batched_decode_step`, all layers alike)."""
        start, n = self._len[layer], int(k.shape[0])
        rows = torch.arange(start, start + n)
        dense = isinstance(self.pool.backend, DenseBlocks)
        if not dense or self.released or not torch.equal(positions.cpu().long(), rows):
            raise PagedCacheError(f"rows of a live dense paged sequence are appended at {start}..")
        while self.num_blocks * self.pool.block_size < start + n:
            self.grow()
        rows = rows.to(self.pool.device)
        bs = self.pool.block_size
        self.pool.backend.put(self.table[layer, rows // bs], rows % bs, k, v)
        self._len[layer] = start + n

    def attend(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        return self.pool.backend.attend(self, layer, q, q_pos)

    @property
    def length(self) -> int:
        return self._len[-1]

    def nbytes(self) -> int:
        """Bytes of the blocks this sequence references, each shared block split among its holders
        (HACK: plus its fp16 staging and sink slots)."""
        ref = self.pool.manager.ref_count
        total = sum(self.pool.block_bytes / ref(b) for b in self.table.flatten().tolist())
        return int(total + self.pool.backend.seq_bytes(self))

    # ---- prompt loading, fusion bookkeeping, release -----------------------------------------------
    def load_prompt(self, k: torch.Tensor, v: torch.Tensor, keys: list[str] | None = None) -> int:
        """Write a prefill's post-RoPE ``k, v [L, N, Hkv, D]``; returns blocks shared instead of stored.

        ``keys[j]`` (optional) is the content key of full block ``j`` when its KV depends on the prompt
        head only; such blocks are shared with any live sequence that registered the same key. Every
        block is taken before anything is written: on ``OutOfBlocksError`` nothing changed.
        """
        L, n = int(k.shape[0]), int(k.shape[1])
        if any(self._len) or self.released or L != self.num_layers:
            raise PagedCacheError(
                f"load_prompt of {L} layers on a used sequence or a {self.num_layers}-layer pool"
            )
        pool, mgr, bs, keys = self.pool, self.pool.manager, self.pool.block_size, keys or []
        shared = pool.shared_blocks(keys, n)
        js, nblk = [len(s) for s in shared], -(-n // bs)
        fresh = iter(mgr.allocate(L * nblk - sum(js)))
        for b in itertools.chain(*shared):
            mgr.incref(b)
        self._append(torch.tensor([s + [next(fresh) for _ in range(nblk - len(s))] for s in shared]))
        pool.backend.load_prompt(self, k, v, js)
        self._len = [n] * L
        tab = self.table.tolist()
        for layer, j in itertools.product(range(L), range(min(len(keys), pool.sealed_blocks(n)))):
            mgr.register((keys[j], layer), tab[layer][j])
        return sum(js)

    def set_norms(self, layer: int, j: int, k_norm: float, v_norm: float) -> None:
        """Entry ``j`` of ``layer`` is a fused member: its norms, and it is never fused again."""
        self.norms[0, layer, j], self.norms[1, layer, j] = k_norm, v_norm
        self.fused[layer].add(j)

    def fusable_blocks(self, layer: int) -> int:
        """Leading blocks BFF/CFF may fuse: full ones (HACK: sealed ones, quantized in their pages)."""
        return self.pool.backend.fusable_blocks(self, layer)

    def references(self) -> Counter:
        """How many times this sequence references each physical block (all layers)."""
        return Counter(self.table.flatten().tolist())

    def release(self) -> None:
        """Drop every block reference (idempotent)."""
        if self.released:
            return
        self.pool.backend.release(self)
        for b in self.table.flatten().tolist():
            self.pool.manager.free(b)
        self.table, self.norms = self.table[:, :0], self.norms[:, :, :0]
        self.released = True


class PagedBatchKV:
    """One decode step's K/V over dense paged sequences (a ``LayerKV`` for ``run_layers``): each new row
    goes into its sequence's current block; attention is one padded batch over the tables, norm-aware
    on layers holding fused blocks (masks per distinct window, built once)."""

    def __init__(self, seqs: list[PagedSequence], pos: torch.Tensor, tables: torch.Tensor, norms):
        pool = self.pool = seqs[0].pool
        self.k, self.v = pool.backend.k, pool.backend.v
        bs = pool.block_size
        self.tables, self.norms, self.lengths = tables, norms, pos + 1
        self.cur = tables[:, torch.arange(len(seqs), device=pos.device), pos // bs]  # [L, B]
        self.slot = pos % bs
        self.masks = {w: decode_mask(self.lengths, tables.shape[2] * bs, w) for w in set(pool.windows)}
        self.fused = {layer for s in seqs for layer, f in enumerate(s.fused) if f}
        #: the decode kernel's paged attention (float32 pools on the CPU; else gather and SDPA): each KV head's
        #: rows read once, in place, with the single-sequence step's arithmetic (the same bits for the same rows)
        cpu32 = self.k.dtype == torch.float32 and self.k.device.type == "cpu" and self.k.shape[-1] % 16 == 0
        self.kernel = lowbit_kernel.kernel() if cpu32 and self.k.shape[-1] <= 128 else None

    def write(self, layer, positions, k, v) -> None:
        self.pool.backend.put(self.cur[layer], self.slot, k, v)

    def attend(self, layer, q, q_pos) -> torch.Tensor:
        p, tab, mask = self.pool, self.tables[layer], self.masks[self.pool.windows[layer]]
        if layer not in self.fused:  # plain paged attention unless a sequence holds fused blocks here
            if self.kernel is not None and p.windows[layer] is None:  # the blocks read in place, one call
                return self.kernel.paged_decode_attention(q, self.k, self.v, tab, self.lengths, p.scale)
            return paged_attention(q, self.k, self.v, tab, self.lengths, p.scale, mask=mask)
        kn, vn = self.norms[:, layer]
        return paged_norm_attention(q, self.k, self.v, tab, kn, vn, self.lengths, p.scale, mask=mask)

    def finish(self) -> None:
        pass


@torch.inference_mode()
def batched_decode_step(model, seqs: list[PagedSequence], token_ids: list[int]) -> torch.Tensor:
    """One token per sequence through every layer, appending its KV; returns fp32 logits ``[B, vocab]``.

    Rows run stacked through the projections and MLP (:func:`ragkv.model.forward.run_layers`); RoPE
    is applied at each sequence's own position; attention is one padded batch over the stacked block
    tables (:class:`PagedBatchKV`), or one HACK batch over quantized pages
    (the backend's ``decode_kv``: :class:`~ragkv.attention.hack_seq.HackStep` for HACK). Greedy tokens match
    :func:`ragkv.generate.decode_step` on each sequence alone.
    """
    if not seqs:
        raise ValueError("batched_decode_step needs at least one sequence")
    pool, dev = seqs[0].pool, model.device
    positions = [s.length for s in seqs]
    for s, p in zip(seqs, positions, strict=True):
        if p == s.num_blocks * pool.block_size:  # the new row starts a block (in every layer)
            s.grow()
    tables, norms = batch_tables(seqs)
    pos = torch.tensor(positions, dtype=torch.long, device=pool.device)
    kv = pool.backend.decode_kv(seqs, pos, tables, norms)
    ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
    m = decoder(model)  # the model's decode weights
    h, _ = run_layers(m, m.embed(ids), pos.to(dev), kv)
    kv.finish()
    for s, p in zip(seqs, positions, strict=True):
        s._len = [p + 1] * s.num_layers
    return m.logits(h).float()
