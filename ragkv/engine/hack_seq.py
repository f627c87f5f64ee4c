"""HACK paged sequences: loading a prompt into pages, batched decode steps, and the attention batch.

A sequence's HACK state (:class:`HackSeqState`) is layer-independent: every layer holds the same
rows, so the rows whose K is quantized (``kq``), the sealed blocks and the open blocks' staging slots
are shared by all layers (only block tables differ per layer, after fusion). A decode step
(:class:`HackStep`) plans once for the batch (new blocks, the rows leaving the window, the blocks
to seal, the attention masks) and then, per layer, writes the new rows and runs one
:func:`ragkv.attention.hack_batch.hack_decode` for the whole batch. See ``hack_blocks`` for the
storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ragkv.attention.hack_batch import HackDecodeBatch, hack_decode

if TYPE_CHECKING:
    from ragkv.engine.paged_cache import PagedSequence


@dataclass
class HackSeqState:
    """Where a sequence's rows are (every layer alike)."""

    kq: int = 0  # rows [0, kq) have their K quantized in the pages
    sealed: int = 0  # blocks [0, sealed) have their V quantized in the pages
    open: list[int] = field(default_factory=list)  # staging slot of block ``sealed + i``
    sink: int = 0  # sink slot (when the pool keeps sinks)


def _targets(pool, length: int) -> tuple[int, int]:
    """(kq, sealed) for a sequence of ``length`` rows."""
    kq = max(0, length - pool.hack.window)
    return kq, kq // pool.block_size


def load_prompt(seq: PagedSequence, k: Tensor, v: Tensor, keys: list[str]) -> int:
    """Write a prompt's ``k, v [L, N, Hkv, D]`` into pages and staging; returns blocks shared."""
    pool, hp = seq.pool, seq.pool.hack
    mgr, bs = pool.manager, pool.block_size
    L, n = int(k.shape[0]), int(k.shape[1])
    st = seq.hack_state
    hp.fix_stats(k)
    kq, sealed = _targets(pool, n)
    nblk = -(-n // bs)
    dev = pool.device
    shared = 0
    own: list[tuple[int, int]] = []  # (layer, block index) of sealed blocks this sequence writes
    for layer in range(L):
        j = seq.adopt_shared(layer, keys, sealed)  # only blocks this sequence seals may be shared
        shared += j
        own += [(layer, jj) for jj in range(j, sealed)]
        while len(seq.tables[layer]) < nblk:
            seq._new_block(layer)
    k16, v16 = k.to(dev, torch.float16), v.to(dev, torch.float16)
    if own:
        li = torch.tensor([a for a, _ in own], dtype=torch.long, device=dev)
        ji = torch.tensor([b for _, b in own], dtype=torch.long, device=dev)
        pages = torch.tensor([seq.tables[a][b] for a, b in own], dtype=torch.long, device=dev)
        kb = k16[:, : sealed * bs].reshape(L, sealed, bs, *k16.shape[2:])
        vb = v16[:, : sealed * bs].reshape(L, sealed, bs, *v16.shape[2:])
        hp.write_blocks(pages, li, kb[li, ji], vb[li, ji], ji == 0)
    for j in range(sealed, nblk):  # open blocks: fp16 staging (every layer)
        slot = hp.stage.take()
        rows = min(bs, n - j * bs)
        hp.stage.k[slot, :, :rows] = k16[:, j * bs : j * bs + rows]
        hp.stage.v[slot, :, :rows] = v16[:, j * bs : j * bs + rows]
        st.open.append(slot)
    if kq > sealed * bs:  # quantized K of open blocks (rows that left the window)
        r = torch.arange(sealed * bs, kq, device=dev)
        lr = torch.arange(L, device=dev).repeat_interleave(r.numel())
        rr = r.repeat(L)
        tab = torch.tensor(seq.tables, dtype=torch.long, device=dev)
        hp.quantize_k(tab[lr, rr // bs], rr % bs, lr, k16[lr, rr])
    if hp.sinks is not None:
        st.sink = hp.sinks.take()
        s = min(hp.sink_tokens, n)
        hp.sinks.k[st.sink, :, :s] = k16[:, :s]
        hp.sinks.v[st.sink, :, :s] = v16[:, :s]
    for layer in range(L):
        for jj in range(min(len(keys), sealed)):
            mgr.register((keys[jj], layer), seq.tables[layer][jj])
    st.kq, st.sealed = kq, sealed
    seq._len = [n] * L
    return shared


def release(seq: PagedSequence) -> None:
    """Give the sequence's staging and sink slots back."""
    hp, st = seq.pool.hack, seq.hack_state
    for slot in st.open:
        hp.stage.give(slot)
    st.open = []
    if hp.sinks is not None and st.sink >= 0:
        hp.sinks.give(st.sink)
        st.sink = -1


def _pad_tables(seqs: list[PagedSequence], attr: str, fill, device, dtype) -> Tensor:
    """``[L, B, NB]`` of per-layer lists ``attr`` (tables or norms), padded with ``fill``."""
    nb = max(len(t) for s in seqs for t in s.tables)
    rows = [[list(t) + [fill] * (nb - len(t)) for t in getattr(s, attr)] for s in seqs]
    return torch.tensor(rows, dtype=dtype, device=device).transpose(0, 1)


class HackAttendPlan:
    """Layer-independent parts of the attention batch for query rows over HACK sequences."""

    def __init__(
        self,
        pool,
        seqs: list[PagedSequence],
        q_pos: Tensor,
        kq: Tensor,
        sealed: Tensor,
        lengths: Tensor,
        open_slots: list[list[int]],
    ):
        hp, bs, dev = pool.hack, pool.block_size, pool.device
        self.pool, self.hp = pool, hp
        b = len(seqs)
        self.q_pos, self.kq, self.sealed, self.lengths = q_pos, kq, sealed, lengths
        self.nb = int(-(-int(kq.max()) // bs)) if b else 0
        self.no = max((len(o) for o in open_slots), default=0)
        self.open_slots = torch.tensor(
            [o + [0] * (self.no - len(o)) for o in open_slots], dtype=torch.long, device=dev
        ).view(b, self.no)
        self.sink_slots = torch.tensor([s.hack_state.sink for s in seqs], dtype=torch.long, device=dev)
        self.tables = _pad_tables(seqs, "tables", 0, dev, torch.long)  # [L, B, NBall]
        fused = any(s.fused[layer] for s in seqs for layer in range(s.num_layers))
        self.k_norm = _pad_tables(seqs, "k_norm", 1.0, dev, torch.float32) if fused else None
        self.v_norm = _pad_tables(seqs, "v_norm", 1.0, dev, torch.float32) if fused else None
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
        out = (page_mask, sealed, open_block, open_kmask, open_pmask, sink_mask)
        self._masks[window] = out
        return out

    def attend(self, layer: int, q: Tensor) -> Tensor:
        """HACK attention of ``q [B, Hq, D]`` (one row per plan row) in ``layer``: fp32 ``[B, Hq, D]``."""
        pool, hp = self.pool, self.hp
        page_mask, sealed, open_block, open_kmask, open_pmask, sink_mask = self.masks(pool.windows[layer])
        nb, b, bs = self.nb, q.shape[0], pool.block_size
        sinks = hp.sinks
        if sinks is not None:
            sk, sv = sinks.k[self.sink_slots, layer], sinks.v[self.sink_slots, layer]
        else:
            sk = sv = q.new_zeros(b, 0, hp.hkv, hp.d, dtype=torch.float16)
        if self.no:
            ok, ov = hp.stage.k[self.open_slots, layer], hp.stage.v[self.open_slots, layer]
        else:
            ok = ov = q.new_zeros(b, 0, bs, hp.hkv, hp.d, dtype=torch.float16)
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
            k_norm=self.k_norm[layer, :, :nb] if self.k_norm is not None else None,
            v_norm=self.v_norm[layer, :, :nb] if self.v_norm is not None else None,
            k_shift=hp.k_shift[layer] if hp.k_shift is not None else None,
            q_mul=hp.k_div[layer] if hp.k_div is not None else None,
        )
        out = hack_decode(q, hp.pages, hp.layout, batch, pool.scale, qp_bits=hp.cfg.qp_bits)
        return out.to(q.dtype)


def attend_one(seq: PagedSequence, layer: int, q: Tensor, q_pos: Tensor) -> Tensor:
    """HACK attention of ``q [n, Hq, D]`` at ``q_pos [n]`` over one sequence's rows."""
    dev, st, n = seq.pool.device, seq.hack_state, q.shape[0]
    full = lambda x: torch.full((n,), x, dtype=torch.long, device=dev)  # noqa: E731
    plan = HackAttendPlan(
        seq.pool,
        [seq] * n,
        q_pos.to(dev, torch.long),
        full(st.kq),
        full(st.sealed),
        full(seq.layer_length(layer)),
        [st.open] * n,
    )
    return plan.attend(layer, q)


class HackStep:
    """One batched decode step of HACK sequences (a ``LayerKV`` for ``run_layers``)."""

    def __init__(self, seqs: list[PagedSequence], positions: list[int]):
        pool = seqs[0].pool
        hp, bs, dev = pool.hack, pool.block_size, pool.device
        self.seqs, self.pool, self.hp, self.pos_list = seqs, pool, hp, positions
        w, s_tok = hp.window, hp.sink_tokens
        new_slot, q_rows, v_rows = [], [], []
        for i, (s, p) in enumerate(zip(seqs, positions, strict=True)):
            st = s.hack_state
            if p % bs == 0:  # a fresh block in every layer, and its staging slot
                for layer in range(s.num_layers):
                    if p // bs == len(s.tables[layer]):
                        s._new_block(layer)
                st.open.append(hp.stage.take())
            new_slot.append(st.open[p // bs - st.sealed])
            r = p - w  # the row leaving the window (K quantized now)
            if r >= 0:
                q_rows.append((i, r, st.open[r // bs - st.sealed]))
                if (r + 1) % bs == 0:
                    v_rows.append((i, r // bs, st.open[r // bs - st.sealed]))
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        self.pos = pos
        self.new_slot = torch.tensor(new_slot, dtype=torch.long, device=dev)
        self.new_off = pos % bs
        self.sink_sel = (pos < s_tok).nonzero().flatten() if s_tok else None
        self.q_idx = torch.tensor([a for a, _, _ in q_rows], dtype=torch.long, device=dev)
        self.q_row = torch.tensor([r for _, r, _ in q_rows], dtype=torch.long, device=dev)
        self.q_slot = torch.tensor([c for _, _, c in q_rows], dtype=torch.long, device=dev)
        self.v_idx = torch.tensor([a for a, _, _ in v_rows], dtype=torch.long, device=dev)
        self.v_blk = torch.tensor([j for _, j, _ in v_rows], dtype=torch.long, device=dev)
        self.v_slot = torch.tensor([c for _, _, c in v_rows], dtype=torch.long, device=dev)
        lengths = pos + 1
        kq = (lengths - w).clamp(min=0)
        self.kq_after, self.sealed_after = kq, kq // bs
        # W > 0: the row leaving the window is quantized after the step, for every layer in one call
        # (this step still sees it in fp16); W = 0 (HACK's scheme): at once, layer by layer
        self.defer = w > 0
        if self.defer:
            kq = torch.tensor([s.hack_state.kq for s in seqs], dtype=torch.long, device=dev)
            sealed = torch.tensor([s.hack_state.sealed for s in seqs], dtype=torch.long, device=dev)
            opens = [s.hack_state.open for s in seqs]
        else:
            sealed = self.sealed_after
            opens = [
                s.hack_state.open[sa - s.hack_state.sealed :]
                for s, sa in zip(seqs, sealed.tolist(), strict=True)
            ]
        self.plan = HackAttendPlan(pool, seqs, pos, kq, sealed, lengths, opens)

    def write(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
        hp, tabs = self.hp, self.plan.tables[layer]
        hp.stage.k[self.new_slot, layer, self.new_off] = k.to(torch.float16)
        hp.stage.v[self.new_slot, layer, self.new_off] = v.to(torch.float16)
        if self.sink_sel is not None and self.sink_sel.numel():
            sel = self.sink_sel
            slots = self.plan.sink_slots[sel]
            hp.sinks.k[slots, layer, self.pos[sel]] = k[sel].to(torch.float16)
            hp.sinks.v[slots, layer, self.pos[sel]] = v[sel].to(torch.float16)
        bs = self.pool.block_size
        if self.defer:
            return
        if self.q_idx.numel():
            off = self.q_row % bs
            rows = hp.stage.k[self.q_slot, layer, off]
            layers = torch.full_like(self.q_idx, layer)
            hp.quantize_k(tabs[self.q_idx, self.q_row // bs], off, layers, rows)
        if self.v_idx.numel():
            pages = tabs[self.v_idx, self.v_blk]
            hp.seal_v(pages, hp.stage.v[self.v_slot, layer], self.v_blk == 0)

    def attend(self, layer: int, q: Tensor, q_pos: Tensor) -> Tensor:
        return self.plan.attend(layer, q)

    def _quantize_all_layers(self) -> None:
        """The rows that left the window (K) and the blocks they complete (V), every layer at once."""
        hp, bs, tabs = self.hp, self.pool.block_size, self.plan.tables  # tabs [L, B, NB]
        L = tabs.shape[0]
        lay = torch.arange(L, device=tabs.device)
        if self.q_idx.numel():
            m = self.q_idx.numel()
            off = self.q_row % bs
            rows = hp.stage.k[self.q_slot, :, off]  # [M, L, H, D]
            pages = tabs[:, self.q_idx, self.q_row // bs].T  # [M, L]
            hp.quantize_k(
                pages.reshape(-1),
                off.repeat_interleave(L),
                lay.repeat(m),
                rows.reshape(m * L, *rows.shape[2:]),
            )
        if self.v_idx.numel():
            m = self.v_idx.numel()
            pages = tabs[:, self.v_idx, self.v_blk].T.reshape(-1)
            v = hp.stage.v[self.v_slot].reshape(m * L, *hp.stage.v.shape[2:])
            hp.seal_v(pages, v, (self.v_blk == 0).repeat_interleave(L))

    def finish(self) -> None:
        """Every layer holds the new rows: advance each sequence and free the sealed blocks' slots."""
        hp = self.hp
        if self.defer:
            self._quantize_all_layers()
        for s, p, kq, sa in zip(
            self.seqs, self.pos_list, self.kq_after.tolist(), self.sealed_after.tolist(), strict=True
        ):
            st = s.hack_state
            done = sa - st.sealed
            for slot in st.open[:done]:
                hp.stage.give(slot)
            st.open = st.open[done:]
            st.kq, st.sealed = kq, sa
            s._len = [p + 1] * s.num_layers
