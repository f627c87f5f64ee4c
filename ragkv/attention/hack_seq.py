"""The engine's HACK KV backend (:class:`HackKV`): a prompt into pages, the batched decode step, the attention batch.

``EngineConfig(attention="hack")`` stores a paged pool's blocks as HACK pages (:mod:`ragkv.attention.hack_blocks`)
instead of the default dense blocks (``ragkv.engine.paged_cache.DenseBlocks``); both are the engine's
``KVBackend`` (``ragkv/engine/backend.py``). A sequence's HACK state is layer-independent (every layer holds the same rows; only tables differ,
after fusion). A decode step (:class:`HackStep`) plans once for the batch, then per layer writes the
new rows and runs one :func:`ragkv.attention.hack_batch.hack_decode` for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ragkv.attention.hack_batch import HackDecodeBatch, hack_decode
from ragkv.attention.hack_blocks import HackPages
from ragkv.attention.hack_cache import HackConfig, default_config
from ragkv.attention.hack_paged import PagedLayout
from ragkv.attention.paged import batch_tables


@dataclass
class HackSeqState:
    """Where a sequence's rows are (every layer alike)."""

    kq: int = 0  # rows [0, kq) have their K quantized in the pages
    sealed: int = 0  # blocks [0, sealed) have their V quantized in the pages
    open: list[int] = field(default_factory=list)  # staging slot of block ``sealed + i``
    sink: int = -1  # sink slot (when the pool keeps sinks)


def _long(xs, dev) -> Tensor:
    return torch.tensor(xs, dtype=torch.long, device=dev)


class HackAttendPlan:
    """Layer-independent parts of the attention batch for query rows over HACK sequences."""

    def __init__(
        self, pool, seqs, q_pos: Tensor, kq: Tensor, sealed: Tensor, lengths: Tensor, open_slots, tables=None
    ):
        hp, bs, dev = pool.backend, pool.block_size, pool.device
        self.pool, self.hp = pool, hp
        if tables is None:
            tables = batch_tables(seqs)
        self.tables, norms = tables  # [L, B, NB], [2, L, B, NB] or None
        self.k_norm, self.v_norm = (None, None) if norms is None else norms
        self.q_pos, self.kq, self.sealed, self.lengths = q_pos, kq, sealed, lengths
        self.nb = -(-int(kq.max()) // bs) if len(seqs) else 0
        self.no = max((len(o) for o in open_slots), default=0)
        self.open_slots = _long([o + [0] * (self.no - len(o)) for o in open_slots], dev).view(
            len(seqs), self.no
        )
        self.sink_slots = _long([s.state.sink for s in seqs], dev)
        self._masks: dict = {}

    def masks(self, window: int | None) -> tuple[Tensor, ...]:
        """(page_mask, sealed, open_block, open_kmask, open_pmask, sink_mask) for a sliding window."""
        if window in self._masks:
            return self._masks[window]
        bs, s_tok, dev = self.pool.block_size, self.hp.sink_tokens, self.pool.device
        q, kq = self.q_pos[:, None], self.kq[:, None]

        def vis(p: Tensor) -> Tensor:
            m = p <= q
            return m if window is None else m & (p > q - window)

        t = torch.arange(self.nb * bs, device=dev)[None]
        page_mask = (t < kq) & (t >= s_tok) & vis(t)
        sealed = torch.arange(self.nb, device=dev)[None] < self.sealed[:, None]
        oj = self.sealed[:, None] + torch.arange(self.no, device=dev)[None]  # [B, NO]
        nblk = (self.lengths + bs - 1) // bs
        ovalid = (oj < nblk[:, None]).repeat_interleave(bs, 1)
        opos = (oj[..., None] * bs + torch.arange(bs, device=dev)).reshape(len(self.q_pos), -1)
        base = ovalid & (opos >= s_tok) & vis(opos)
        open_kmask = base & (opos >= kq) & (opos < self.lengths[:, None])
        open_pmask = base & (opos < kq)
        open_block = oj.clamp(max=max(self.nb - 1, 0))
        sp = torch.arange(s_tok, device=dev)[None]
        sink_mask = (sp < self.lengths[:, None]) & vis(sp)
        out = self._masks[window] = (page_mask, sealed, open_block, open_kmask, open_pmask, sink_mask)
        return out

    def attend(self, layer: int, q: Tensor) -> Tensor:
        """HACK attention of ``q [B, Hq, D]`` (one row per plan row) in ``layer``: ``[B, Hq, D]``."""
        pool, hp, nb, b, bs = self.pool, self.hp, self.nb, q.shape[0], self.pool.block_size
        page_mask, sealed, open_block, open_kmask, open_pmask, sink_mask = self.masks(pool.windows[layer])
        if hp.sinks is not None:
            sk, sv = hp.sinks.k[self.sink_slots, layer], hp.sinks.v[self.sink_slots, layer]
        else:
            sk = sv = q.new_zeros(b, 0, hp.hkv, hp.d, dtype=torch.float16)
        if self.no:
            ok, ov = hp.stage.k[self.open_slots, layer], hp.stage.v[self.open_slots, layer]
        else:
            ok = ov = q.new_zeros(b, 0, bs, hp.hkv, hp.d, dtype=torch.float16)
        norm = lambda x: x[layer, :, :nb] if x is not None else None  # noqa: E731
        batch = HackDecodeBatch(
            table=self.tables[layer, :, :nb],
            page_mask=page_mask,
            sealed=sealed,
            open_k=ok,
            open_v=ov,
            open_block=open_block,
            open_kmask=open_kmask,
            open_pmask=open_pmask,
            sink_k=sk,
            sink_v=sv,
            sink_mask=sink_mask,
            k_norm=norm(self.k_norm),
            v_norm=norm(self.v_norm),
            k_shift=hp.k_shift[layer] if hp.k_shift is not None else None,
            q_mul=hp.k_div[layer] if hp.k_div is not None else None,
            k_order=hp.k_order[layer] if hp.k_order is not None else None,
        )
        return hack_decode(q, hp.pages, hp.layout, batch, pool.scale, qp_bits=hp.cfg.qp_bits).to(q.dtype)


class HackStep:
    """One batched decode step of HACK sequences (a ``LayerKV`` for ``run_layers``); blocks are taken
    by :func:`~ragkv.engine.paged_cache.batched_decode_step`, staging slots here."""

    def __init__(self, seqs, pos: Tensor, tables: Tensor, norms: Tensor | None):
        pool = seqs[0].pool
        hp, bs, dev = pool.backend, pool.block_size, pool.device
        self.seqs, self.pool, self.hp, self.tables = seqs, pool, hp, tables
        w, s_tok = hp.window, hp.sink_tokens
        new_slot, q_rows, v_rows = [], [], []
        for i, (s, p) in enumerate(zip(seqs, pos.tolist(), strict=True)):
            st = s.state
            if p % bs == 0:  # a fresh block: its staging slot
                st.open.append(hp.stage.take())
            new_slot.append(st.open[p // bs - st.sealed])
            r = p - w  # the row leaving the window (K quantized now)
            if r >= 0:
                q_rows.append((i, r, st.open[r // bs - st.sealed]))
                if (r + 1) % bs == 0:
                    v_rows.append((i, r // bs, st.open[r // bs - st.sealed]))
        self.pos, self.new_slot, self.new_off = pos, _long(new_slot, dev), pos % bs
        self.sink_sel = (pos < s_tok).nonzero().flatten() if s_tok else None
        self.q_idx, self.q_row, self.q_slot = _long(q_rows, dev).view(-1, 3).T
        self.v_idx, self.v_blk, self.v_slot = _long(v_rows, dev).view(-1, 3).T
        lengths = pos + 1
        self.kq_after = (lengths - w).clamp(min=0)
        self.sealed_after = self.kq_after // bs
        # W > 0: the row leaving the window is quantized after the step, for every layer in one call
        # (this step still sees it in fp16); W = 0 (HACK's scheme): at once, layer by layer
        self.defer = w > 0
        if self.defer:
            kq = _long([s.state.kq for s in seqs], dev)
            sealed = _long([s.state.sealed for s in seqs], dev)
            opens = [s.state.open for s in seqs]
        else:
            kq, sealed = self.kq_after, self.sealed_after
            opens = [s.state.open[sa - s.state.sealed :] for s, sa in zip(seqs, sealed.tolist(), strict=True)]
        self.plan = HackAttendPlan(pool, seqs, pos, kq, sealed, lengths, opens, (tables, norms))

    def write(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
        hp, tabs = self.hp, self.tables[layer]
        hp.stage.k[self.new_slot, layer, self.new_off] = k.to(torch.float16)
        hp.stage.v[self.new_slot, layer, self.new_off] = v.to(torch.float16)
        if self.sink_sel is not None and self.sink_sel.numel():
            sel = self.sink_sel
            slots = self.plan.sink_slots[sel]
            hp.sinks.k[slots, layer, self.pos[sel]] = k[sel].to(torch.float16)
            hp.sinks.v[slots, layer, self.pos[sel]] = v[sel].to(torch.float16)
        if not self.defer:
            self._quantize(tabs[None], torch.full((1,), layer, device=tabs.device))

    def attend(self, layer: int, q: Tensor, q_pos: Tensor) -> Tensor:
        return self.plan.attend(layer, q)

    def _quantize(self, tabs: Tensor, layers: Tensor) -> None:
        """The rows that left the window (K) and the blocks they complete (V) of ``layers`` (tables
        ``tabs [len(layers), B, NB]``), in one call each."""
        hp, bs, m = self.hp, self.pool.block_size, len(layers)
        if self.q_idx.numel():
            off = self.q_row % bs
            rows = hp.stage.k[self.q_slot[:, None], layers[None], off[:, None]]  # [Q, m, H, D]
            pages = tabs[:, self.q_idx, self.q_row // bs].T  # [Q, m]
            n = self.q_idx.numel()
            hp.quantize_k(pages.reshape(-1), off.repeat_interleave(m), layers.repeat(n), rows.flatten(0, 1))
        if self.v_idx.numel():
            pages = tabs[:, self.v_idx, self.v_blk].T.reshape(-1)
            v = hp.stage.v[self.v_slot[:, None], layers[None]].flatten(0, 1)
            hp.seal_v(pages, v, (self.v_blk == 0).repeat_interleave(m))

    def finish(self) -> None:
        """Every layer holds the new rows: quantize what left the window, free the sealed blocks' slots."""
        hp = self.hp
        if self.defer:
            self._quantize(self.tables, torch.arange(self.tables.shape[0], device=self.tables.device))
        for s, kq, sa in zip(self.seqs, self.kq_after.tolist(), self.sealed_after.tolist(), strict=True):
            st = s.state
            for slot in st.open[: sa - st.sealed]:
                hp.stage.give(slot)
            st.open = st.open[sa - st.sealed :]
            st.kq, st.sealed = kq, sa


class HackKV(HackPages):
    """The engine's HACK KV backend: a paged pool's blocks are quantized pages (plus bounded fp16
    staging); a sequence's rows enter through its prompt and the batched decode step (:class:`HackStep`)."""

    staged = True  # fp16 staging beside the blocks: peak bytes are sampled, not the allocator's
    scaled_representatives = True  # a fused representative is stored as its home member's reconstruction
    dtype = torch.float16  # unquantized rows are fp16, as HackKVCache keeps them

    @staticmethod
    def engine_config(options: dict, head_dim: int, block_size: int) -> HackConfig:
        """HACK's defaults with ``options`` over them; V partition = block size (a preset that names no
        K partition keeps the pages' 64)."""
        return default_config(options, head_dim, block_size, preset_k_partition=64)

    @staticmethod
    def page_bytes_for(cfg: HackConfig, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one page: a byte budget buys this many more blocks than dense ones."""
        return PagedLayout.for_config(cfg, block_size, num_kv_heads, head_dim).page_bytes

    @property
    def block_bytes(self) -> int:
        return self.page_bytes

    def sealed_rows(self, num_tokens: int) -> int:
        """Leading rows of a ``num_tokens``-row sequence that are quantized (out of the recent window)."""
        return max(0, num_tokens - self.window)

    def new_state(self) -> HackSeqState:
        return HackSeqState()

    def fusable_blocks(self, seq, layer: int) -> int:
        """Sealed blocks (quantized in their pages)."""
        return seq.state.sealed

    def decode_kv(self, seqs, pos: Tensor, tables: Tensor, norms: Tensor | None) -> HackStep:
        return HackStep(seqs, pos, tables, norms)

    def load_prompt(self, seq, k: Tensor, v: Tensor, js: list[int]) -> None:
        """Write a prompt's ``k, v [L, N, Hkv, D]`` into the sequence's pages (those of layer ``l`` from
        block ``js[l]`` on: the ones before are shared) and its staging and sink slots."""
        hp, bs, dev = self, seq.pool.block_size, seq.pool.device
        L, n = int(k.shape[0]), int(k.shape[1])
        st = seq.state
        hp.fix_stats(k)
        kq = max(0, n - hp.window)
        sealed = kq // bs
        k16, v16 = k.to(dev, torch.float16), v.to(dev, torch.float16)
        own = [(layer, j) for layer in range(L) for j in range(js[layer], sealed)]
        if own:  # sealed blocks this sequence stores: quantized whole
            li, ji = _long([a for a, _ in own], dev), _long([b for _, b in own], dev)
            kb = k16[:, : sealed * bs].unflatten(1, (sealed, bs))
            vb = v16[:, : sealed * bs].unflatten(1, (sealed, bs))
            hp.write_blocks(seq.table[li, ji], li, kb[li, ji], vb[li, ji], ji == 0)
        for j in range(sealed, -(-n // bs)):  # open blocks: fp16 staging (every layer)
            slot, rows = hp.stage.take(), min(bs, n - j * bs)
            hp.stage.k[slot, :, :rows] = k16[:, j * bs : j * bs + rows]
            hp.stage.v[slot, :, :rows] = v16[:, j * bs : j * bs + rows]
            st.open.append(slot)
        if kq > sealed * bs:  # quantized K of open blocks (rows that left the window)
            r = torch.arange(sealed * bs, kq, device=dev)
            lr, rr = torch.arange(L, device=dev).repeat_interleave(r.numel()), r.repeat(L)
            hp.quantize_k(seq.table[lr, rr // bs], rr % bs, lr, k16[lr, rr])
        if hp.sinks is not None:
            st.sink = hp.sinks.take()
            s = min(hp.sink_tokens, n)
            hp.sinks.k[st.sink, :, :s], hp.sinks.v[st.sink, :, :s] = k16[:, :s], v16[:, :s]
        st.kq, st.sealed = kq, sealed

    def release(self, seq) -> None:
        """Give the sequence's staging and sink slots back."""
        hp, st = self, seq.state
        for slot in st.open:
            hp.stage.give(slot)
        st.open = []
        if hp.sinks is not None and st.sink >= 0:
            hp.sinks.give(st.sink)
            st.sink = -1

    def seq_bytes(self, seq) -> int:
        """fp16 bytes of the sequence's staging and sink slots."""
        hp = self
        return len(seq.state.open) * hp.stage.slot_bytes + (hp.sinks.slot_bytes if hp.sinks else 0)

    def attend(self, seq, layer: int, q: Tensor, q_pos: Tensor) -> Tensor:
        """HACK attention of ``q [n, Hq, D]`` at ``q_pos [n]`` over one sequence's rows."""
        dev, st, n = seq.pool.device, seq.state, q.shape[0]
        full = lambda x: torch.full((n,), x, dtype=torch.long, device=dev)  # noqa: E731
        length = full(seq._len[layer])
        plan = HackAttendPlan(
            seq.pool,
            [seq] * n,
            q_pos.to(dev, torch.long),
            full(st.kq),
            full(st.sealed),
            length,
            [st.open] * n,
        )
        return plan.attend(layer, q)
