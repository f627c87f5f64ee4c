"""HACK storage of the engine's paged KV: quantized pages only, plus small bounded fp16 staging.

Pages: one uint8 tensor in the vLLM backend's page layout (:class:`ragkv.attention.hack_paged.PagedLayout`),
a page per block of one layer, no fp16 copy. Staging: one fp16 slot ``[L, block_size, Hkv, D]`` per
open block of a running sequence (rows in the recent window, or a V partition not full yet) and one
sink slot ``[L, S, Hkv, D]`` per sequence. K smoothing statistics are per layer for the whole pool,
fixed by the first prompt, so shared and fused blocks are in one basis. Row life, sinks and fusion
of quantized blocks: docs/ENGINE.md, "HACK".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ragkv.attention.hack_cache import HackConfig, smooth_stats
from ragkv.attention.hack_paged import PagedLayout, page_views, stack_key_plans
from ragkv.attention.hack_quant import (
    HackConfigError,
    KeyPlan,
    Quantized,
    quantize_k_rows,
    quantize_v_partitions,
    unpack_codes_float,
    unpack_parts,
)


class SlotPool:
    """fp16 K/V slots of one shape with a free list, grown on demand (physical bytes = capacity)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device):
        self.shape = shape
        self.k = torch.zeros(0, *shape, dtype=torch.float16, device=device)
        self.v = torch.zeros_like(self.k)
        self.free: list[int] = []

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    @property
    def in_use(self) -> int:
        return self.capacity - len(self.free)

    @property
    def slot_bytes(self) -> int:
        return 2 * 2 * math.prod(self.shape)

    def take(self) -> int:
        if not self.free:
            n = self.capacity
            m = n + max(1, n // 8)  # small steps: the capacity (physical bytes) stays near the peak in use
            k = torch.zeros(m, *self.shape, dtype=torch.float16, device=self.k.device)
            v = torch.zeros_like(k)
            k[:n], v[:n] = self.k, self.v
            self.k, self.v = k, v
            self.free.extend(range(m - 1, n - 1, -1))
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class HackPages:
    """Quantized pages, fp16 staging slots and K smoothing statistics of a HACK :class:`KVPool`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        hkv: int,
        d: int,
        cfg: HackConfig,
        device: torch.device,
        key_plans: Sequence[KeyPlan] | None = None,
    ):
        if cfg.partition != block_size:
            raise HackConfigError(
                f"the engine's HACK V partition must equal the KV block size ({block_size}), got {cfg.partition}"
            )
        self.cfg = cfg
        self.layout = PagedLayout.for_config(cfg, block_size, hkv, d)
        #: RoPE-aware keys: page K channels in each layer's plan order ``[L, Hkv, D]``
        self.k_order = stack_key_plans(cfg, key_plans, self.layout, num_layers, device)
        self.pages = self.layout.allocate(num_blocks, device)
        self.views = page_views(self.pages, self.layout)
        self.bs, self.hkv, self.d, self.num_layers = block_size, hkv, d, num_layers
        self.sink_tokens, self.window = cfg.sink_tokens, cfg.recent_window
        self.stage = SlotPool((num_layers, block_size, hkv, d), device)
        self.sinks = SlotPool((num_layers, cfg.sink_tokens, hkv, d), device) if cfg.sink_tokens else None
        self.k_shift: Tensor | None = None  # fp32 [L, Hkv, D] (K smoothing), fixed by the first prompt
        self.k_div: Tensor | None = None
        self.gen = torch.Generator().manual_seed(cfg.seed) if cfg.stochastic else None
        self.device = device

    # ---- bytes ------------------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one page (one layer's block, every head)."""
        return self.layout.page_bytes

    def staging_bytes_in_use(self) -> int:
        """fp16 bytes of the staging slots held by sequences now."""
        return sum(p.in_use * p.slot_bytes for p in (self.stage, self.sinks) if p is not None)

    def staging_nbytes(self) -> int:
        """Physical bytes of the fp16 staging (open-block and sink slots: their capacity)."""
        return sum(p.nbytes() for p in (self.stage, self.sinks) if p is not None)

    def nbytes(self) -> int:
        """Physical bytes: every page, the staging capacity, the smoothing statistics."""
        stats = sum(2 * t.numel() for t in (self.k_shift, self.k_div) if t is not None)
        order = self.k_order.numel() if self.k_order is not None else 0  # channel indices fit a byte
        return self.pages.nbytes + self.staging_nbytes() + stats + order

    # ---- K smoothing --------------------------------------------------------------------------------
    def fix_stats(self, k: Tensor) -> None:
        """Fix the pool's K smoothing statistics from a prompt's K ``[L, N, Hkv, D]`` (first call only)."""
        if self.cfg.k_smooth == "none" or self.k_shift is not None:
            return
        stats = [smooth_stats(k[layer], self.cfg.k_smooth) for layer in range(k.shape[0])]
        self.k_shift = torch.stack([s for s, _ in stats]).to(self.device)
        if stats[0][1] is not None:
            self.k_div = torch.stack([dv for _, dv in stats]).to(self.device)

    def _smooth(self, k: Tensor, layers: Tensor, inverse: bool = False) -> Tensor:
        """K rows ``[M, ..., Hkv, D]`` of ``layers [M]`` into the smoothing basis (fp32), or back."""
        k = k.float()
        if self.k_shift is None:
            return k
        shape = (-1,) + (1,) * (k.dim() - 3) + (self.hkv, self.d)
        shift = self.k_shift[layers].view(shape)
        div = self.k_div[layers].view(shape) if self.k_div is not None else 1.0
        return k * div + shift if inverse else (k - shift) / div

    # ---- quantizing into pages ---------------------------------------------------------------------
    def quantize_k(self, pages: Tensor, offs: Tensor, layers: Tensor, k: Tensor) -> None:
        """Quantize K rows ``k [M, Hkv, D]`` into row ``offs[i]`` of page ``pages[i]`` (layer ``layers[i]``)."""
        if not pages.numel():
            return
        cfg, w, lay = self.cfg, self.views, self.layout
        ks = self._smooth(k.half(), layers)
        if self.k_order is not None:  # RoPE-aware keys: stored in the layer's plan order
            ks = ks.gather(-1, self.k_order[layers])
        w.k_packed[pages, offs], w.k_scale[pages, offs], w.k_min[pages, offs], w.k_sum[pages, offs] = (
            quantize_k_rows(ks, lay.key_bits, lay.k_partition, **cfg.rounding(self.gen))
        )

    def seal_v(self, pages: Tensor, v: Tensor, first: Tensor) -> None:
        """Quantize full blocks' V ``[M, bs, Hkv, D]`` into ``pages``; ``first[i]``: block 0 (holds the sinks)."""
        if not pages.numel():
            return
        cfg, s, bs = self.cfg, self.sink_tokens, self.bs
        v = v.half().float()
        if s and 0 < s < bs and bool(first.any()):
            v = v.clone()
            v[first, :s] = v[first, s:].mean(1, keepdim=True)
        vp, vs, vm, vsum = quantize_v_partitions(
            v.reshape(-1, self.hkv, self.d), cfg.bits, bs, **cfg.rounding(self.gen)
        )
        w = self.views
        w.v_packed[pages], w.v_scale[pages], w.v_min[pages], w.v_sum[pages] = (
            vp.view(pages.numel(), bs, self.hkv, -1),
            vs,
            vm,
            vsum,
        )

    def write_blocks(self, pages: Tensor, layers: Tensor, k: Tensor, v: Tensor, first: Tensor) -> None:
        """Quantize whole blocks ``k, v [M, bs, Hkv, D]`` (every row's K and the V partition) into ``pages``."""
        m, bs = pages.numel(), self.bs
        if not m:
            return
        rows = torch.arange(bs, device=pages.device)
        self.quantize_k(
            pages.repeat_interleave(bs),
            rows.repeat(m),
            layers.repeat_interleave(bs),
            k.reshape(m * bs, self.hkv, self.d),
        )
        self.seal_v(pages, v, first)

    def read_blocks(self, pages: Tensor, layers: Tensor) -> tuple[Tensor, Tensor]:
        """Dequantized K (unsmoothed) and V of sealed blocks: fp32 ``[M, bs, Hkv, D]`` each."""
        lay, w = self.layout, self.views
        m, bs, h, d, pk = pages.numel(), self.bs, self.hkv, self.d, lay.k_partition
        kc = unpack_parts(w.k_packed[pages], lay.key_bits, pk, to_float=True).view(m, bs, h, d // pk, pk)
        k = (kc * w.k_scale[pages].float().unsqueeze(-1) + w.k_min[pages].float().unsqueeze(-1)).view(
            m, bs, h, d
        )
        if self.k_order is not None:  # back to the model's channel order
            k = torch.empty_like(k).scatter_(-1, self.k_order[layers][:, None].expand_as(k), k)
        k = self._smooth(k, layers, inverse=True)
        vc = unpack_codes_float(w.v_packed[pages], lay.bits, d).permute(0, 2, 3, 1)  # [M, H, D, bs]
        v = Quantized(vc, w.v_scale[pages], w.v_min[pages]).dequantize().permute(0, 3, 1, 2)
        return k, v.contiguous()
