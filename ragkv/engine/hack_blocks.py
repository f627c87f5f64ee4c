"""HACK 2-bit storage of paged KV blocks, and the per-sequence view that HACK attention runs on.

Layout per physical block (``block_size`` rows, one layer), mirroring ``HackKVCache``:

* K is quantized per token along head_dim as soon as its row is *sealed* (the paper quantizes every
  new K immediately; a sequence whose blocks still wait for BFF keeps them fp16 until fused, so
  that fusion runs on fp16 and the shared blocks are quantized once);
* V is quantized per channel over the block's ``block_size`` tokens once the block is full, so
  HACK's V partition Pi equals the block size (digest D.3: fusion boundaries must align with V
  partitions); until then the block's V rows are the fp16 tail (requantization elimination).

Fused blocks hold the unit direction ``u``; a member's norms fold into the quantization metadata
(digest D.3): its K rows use ``n_K * scale`` and ``n_K * min``, its V partition ``n_V * scale`` and
``n_V * min``; codes and code sums are shared unchanged.
"""

from __future__ import annotations

import torch

from ragkv.attention.hack_cache import HackConfig
from ragkv.attention.hack_quant import (
    HackConfigError,
    packed_width,
    quantize_k_rows,
    quantize_v_partitions,
    sum_dtype,
)
from ragkv.attention.hack_ref import HackLayerView, hack_attention


def _row_and_block_bytes(block_size: int, hkv: int, d: int, cfg: HackConfig) -> tuple[int, int]:
    """Bytes of one quantized K row and of one sealed V block (codes + fp16 scale/min + sums)."""
    pk = cfg.k_part(d)
    pw = packed_width(d, cfg.bits)
    ks = torch.empty(0, dtype=sum_dtype(cfg.bits, pk)).element_size()
    vs = torch.empty(0, dtype=sum_dtype(cfg.bits, block_size)).element_size()
    k_row = hkv * (pw + (d // pk) * (2 + 2 + ks))
    v_block = hkv * (block_size * pw + d * (2 + 2 + vs))
    return k_row, v_block


def sealed_block_bytes(block_size: int, hkv: int, d: int, cfg: HackConfig) -> int:
    """Bytes of a full, sealed (2-bit K and V) block: what a KV byte budget is divided by in HACK mode."""
    k_row, v_block = _row_and_block_bytes(block_size, hkv, d, cfg)
    return block_size * k_row + v_block


class HackBlockStore:
    """Quantized codes and metadata for every block of a :class:`~ragkv.engine.paged_cache.KVPool`."""

    def __init__(self, num_blocks: int, block_size: int, hkv: int, d: int, cfg: HackConfig, device):
        if cfg.partition != block_size:
            raise HackConfigError(
                f"the engine's HACK V partition must equal the KV block size ({block_size}), got {cfg.partition}"
            )
        if cfg.sink_tokens or cfg.recent_window or cfg.k_smooth != "none":
            raise HackConfigError(
                "the paged engine supports HACK without sink tokens, recent window or K smoothing"
            )
        self.cfg = cfg
        self.bs, self.hkv, self.d = block_size, hkv, d
        self.pk = cfg.k_part(d)
        pw = packed_width(d, cfg.bits)
        ksd, vsd = sum_dtype(cfg.bits, self.pk), sum_dtype(cfg.bits, block_size)
        n, g = num_blocks, d // self.pk
        self.k_packed = torch.zeros(n, block_size, hkv, pw, dtype=torch.uint8, device=device)
        self.k_scale = torch.zeros(n, block_size, hkv, g, dtype=torch.float16, device=device)
        self.k_min = torch.zeros_like(self.k_scale)
        self.k_sum = torch.zeros(n, block_size, hkv, g, dtype=ksd, device=device)
        self.v_packed = torch.zeros(n, block_size, hkv, pw, dtype=torch.uint8, device=device)
        self.v_scale = torch.zeros(n, hkv, d, dtype=torch.float16, device=device)
        self.v_min = torch.zeros_like(self.v_scale)
        self.v_sum = torch.zeros(n, hkv, d, dtype=vsd, device=device)
        self.k_rows = [0] * n  # leading rows of the block whose K is quantized
        self.v_sealed = [False] * n
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.k_row_bytes, self.v_block_bytes = _row_and_block_bytes(block_size, hkv, d, cfg)

    def reset(self, block: int) -> None:
        """The block was freed: forget its quantization state."""
        self.k_rows[block] = 0
        self.v_sealed[block] = False

    def seal_k(self, block: int, upto: int, k16: torch.Tensor) -> None:
        """Quantize K rows ``[k_rows[block], upto)`` of ``block`` from its fp16 rows ``k16 [bs, Hkv, D]``."""
        lo = self.k_rows[block]
        if upto <= lo:
            return
        cfg = self.cfg
        packed, scale, mn, sums = quantize_k_rows(
            k16[lo:upto].float(),
            cfg.bits,
            self.pk,
            stochastic=cfg.stochastic,
            generator=self.gen if cfg.stochastic else None,
            clip_ratios=cfg.clip_ratios,
        )
        self.k_packed[block, lo:upto] = packed
        self.k_scale[block, lo:upto] = scale
        self.k_min[block, lo:upto] = mn
        self.k_sum[block, lo:upto] = sums
        self.k_rows[block] = upto

    def seal_v(self, block: int, v16: torch.Tensor) -> None:
        """Quantize the full block's V ``v16 [bs, Hkv, D]`` as one partition per channel."""
        if self.v_sealed[block]:
            return
        cfg = self.cfg
        packed, scale, mn, sums = quantize_v_partitions(
            v16.float(),
            cfg.bits,
            self.bs,
            stochastic=cfg.stochastic,
            generator=self.gen if cfg.stochastic else None,
            clip_ratios=cfg.clip_ratios,
        )
        self.v_packed[block] = packed
        self.v_scale[block] = scale[0]
        self.v_min[block] = mn[0]
        self.v_sum[block] = sums[0]
        self.v_sealed[block] = True

    def block_bytes(self, block: int, rows: int, fp16_row_bytes: int) -> int:
        """Bytes ``block`` holds for its first ``rows`` rows (quantized parts + fp16 rows)."""
        kq = self.k_rows[block]
        k = kq * self.k_row_bytes + (rows - kq) * fp16_row_bytes
        v = self.v_block_bytes if self.v_sealed[block] else rows * fp16_row_bytes
        return k + v

    def attend(
        self,
        k16: torch.Tensor,
        v16: torch.Tensor,
        table: list[int],
        k_norm: list[float],
        v_norm: list[float],
        length: int,
        q: torch.Tensor,
        q_pos: torch.Tensor,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """HACK attention of ``q`` over one sequence-layer's blocks (views built per call)."""
        view = self.view(k16, v16, table, k_norm, v_norm, length)
        out = hack_attention(
            view,
            q,
            q_pos.to(q.device),
            scale,
            sliding_window=sliding_window,
            qp_bits=self.cfg.qp_bits,
            backend=self.cfg.backend,
        )
        return out.to(q.dtype)

    def view(self, k16, v16, table, k_norm, v_norm, length) -> HackLayerView:
        """The sequence-layer as a :class:`HackLayerView` with its norms folded into scale and min.

        Row order: blocks with sealed V first (their K rows all quantized), then quantized-K rows whose
        V is still fp16 (the tail), then fully fp16 rows; softmax does not care about key order.
        """
        bs, dev = self.bs, k16.device
        sealed, tail_rows, dense_rows = [], [], []  # (block index in table), (block, slot, j) ...
        for j, b in enumerate(table):
            rows = min(bs, length - j * bs)
            if rows <= 0:
                break
            if self.v_sealed[b] and rows == bs:
                sealed.append(j)
                continue
            kq = min(self.k_rows[b], rows)
            tail_rows += [(j, s) for s in range(kq)]
            dense_rows += [(j, s) for s in range(kq, rows)]
        tab = torch.tensor(table, dtype=torch.long, device=dev)
        kn = torch.tensor(k_norm, dtype=torch.float32, device=dev)
        vn = torch.tensor(v_norm, dtype=torch.float32, device=dev)
        sj = torch.tensor(sealed, dtype=torch.long, device=dev)
        sb = tab[sj]
        tj = torch.tensor([r[0] for r in tail_rows], dtype=torch.long, device=dev)
        ts = torch.tensor([r[1] for r in tail_rows], dtype=torch.long, device=dev)
        tb = tab[tj]
        dj = torch.tensor([r[0] for r in dense_rows], dtype=torch.long, device=dev)
        ds = torch.tensor([r[1] for r in dense_rows], dtype=torch.long, device=dev)
        db = tab[dj]
        slots = torch.arange(bs, device=dev)
        g = self.k_scale.shape[-1]
        pw = self.k_packed.shape[-1]
        hkv, d = self.hkv, self.d
        # quantized-K rows: sealed blocks (all rows) then tail rows
        kpk = torch.cat([self.k_packed[sb].reshape(-1, hkv, pw), self.k_packed[tb, ts]])
        kfold = torch.cat([kn[sj].repeat_interleave(bs), kn[tj]])[:, None, None]
        ksc = torch.cat([self.k_scale[sb].reshape(-1, hkv, g), self.k_scale[tb, ts]]).float() * kfold
        kmn = torch.cat([self.k_min[sb].reshape(-1, hkv, g), self.k_min[tb, ts]]).float() * kfold
        ksm = torch.cat([self.k_sum[sb].reshape(-1, hkv, g), self.k_sum[tb, ts]])
        kpos = torch.cat([(sj[:, None] * bs + slots[None, :]).reshape(-1), tj * bs + ts])
        vfold = vn[sj][:, None, None]
        return HackLayerView(
            bits=self.cfg.bits,
            k_part=self.pk,
            v_part=bs,
            head_dim=d,
            k_packed=kpk,
            k_scale=ksc,
            k_min=kmn,
            k_sum=ksm,
            k_pos=kpos,
            v_packed=self.v_packed[sb].reshape(-1, hkv, pw),
            v_scale=self.v_scale[sb].float() * vfold,
            v_min=self.v_min[sb].float() * vfold,
            v_sum=self.v_sum[sb],
            v_tail=(v16[tb, ts].float() * vn[tj][:, None, None]).to(torch.float16),
            dense_k=(k16[db, ds].float() * kn[dj][:, None, None]).to(torch.float16),
            dense_v=(v16[db, ds].float() * vn[dj][:, None, None]).to(torch.float16),
            dense_pos=dj * bs + ds,
        )
