"""Decode KV caches: where a sequence's post-RoPE K/V live after prefill.

``write`` appends rows for one layer (at explicit positions); ``attend`` runs attention of new
query rows over everything written for that layer so far, masked by position. The dense cache is
the fp16/bf16/fp32 implementation; ``ragkv.attention.hack_cache.HackKVCache`` is the 2-bit one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from ragkv.attention.buffers import KV_BUFFERS
from ragkv.attention.dense import ContextTemper, explicit_attention, layer_windows, position_mask


def cache_geometry(model) -> dict:
    """The keyword arguments every KV cache (dense, HACK, the engine's block pool) takes from ``model``:
    layers, KV heads, head dim, softmax scale, device and per-layer sliding windows."""
    c = model.config
    return {
        "num_layers": c.num_layers,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "scale": model.scale,
        "device": model.device,
        "sliding_window": c.windows,
    }


class KVCache(ABC):
    """Per-layer append-only KV of one sequence, with attention over it."""

    num_layers: int

    @abstractmethod
    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append rows ``k, v [n, Hkv, D]`` (post-RoPE K) at ``positions [n]`` for ``layer``."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Attention of ``q [n, Hq, D]`` (post-RoPE) over the layer's rows with ``key_pos <= q_pos``."""

    @property
    @abstractmethod
    def length(self) -> int:
        """Rows written to the last layer (the sequence length once a step is complete)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held for KV (exact accounting of what is stored)."""


class DenseKVCache(KVCache):
    """Preallocated K/V per layer, grown by doubling, in the model's dtype. Head-major
    (``[layers, Hkv, capacity, D]``): a decode step reads each KV head's rows as one contiguous run,
    which halves its attention time over a long prompt against the row-major layout (6,000 rows,
    SmolLM2 shapes, 2 threads: 28 vs 78 ms a token) at the price of a transposing copy when the
    prompt's KV is loaded, once a request."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        capacity: int = 256,
        sliding_window: int | None | tuple[int | None, ...] = None,
    ):
        self.num_layers = num_layers
        self.scale = scale
        #: per layer: its sliding window (None: full causal)
        self.windows = layer_windows(sliding_window, num_layers)
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self._k = KV_BUFFERS.empty(shape, dtype, device, rows_dim=2)  # reused memory (attention/buffers.py)
        self._v = KV_BUFFERS.empty(shape, dtype, device, rows_dim=2)
        self._pos = torch.empty(num_layers, capacity, dtype=torch.long, device=device)
        self._len = [0] * num_layers
        #: per layer: the largest position written (a query at or past it sees every row: no mask)
        self._max_pos = [-1] * num_layers
        #: APE tempering of the attention to a blended prompt's reused rows (set by ``load_prompt``)
        self.temper: ContextTemper | None = None

    @classmethod
    def for_model(cls, model, capacity: int = 256) -> DenseKVCache:
        return cls(**cache_geometry(model), dtype=model.dtype, capacity=capacity)

    def _grow(self, need: int) -> None:
        cap = self._k.shape[2]
        if need <= cap:
            return
        new = max(need, 2 * cap)
        for name in ("_k", "_v"):
            old = getattr(self, name)
            t = KV_BUFFERS.empty((*old.shape[:2], new, old.shape[3]), old.dtype, old.device, rows_dim=2)
            t[:, :, :cap] = old
            setattr(self, name, t)
        pos = torch.empty(self.num_layers, new, dtype=torch.long, device=self._pos.device)
        pos[:, :cap] = self._pos
        self._pos = pos

    def _append(self, layer: int, positions: torch.Tensor) -> int:
        """Count rows at ``positions`` in ``layer`` (grown as needed); returns the first row's index."""
        n = positions.numel()
        s = self._len[layer]
        self._grow(s + n)
        self._pos[layer, s : s + n] = positions
        self._len[layer] = s + n
        if n:
            top = int(positions[0]) if n == 1 else int(positions.max())
            self._max_pos[layer] = max(self._max_pos[layer], top)
        return s

    def write(self, layer, positions, k, v):
        n = k.shape[0]
        s = self._append(layer, positions)
        self._k[layer, :, s : s + n] = k.transpose(0, 1)
        self._v[layer, :, s : s + n] = v.transpose(0, 1)

    def decode_slot(
        self, layer: int, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int, float] | None:
        """Where one decode row's K/V go when a fused step writes and attends in one call: ``(K, V, row,
        scale)`` of the layer (``[Hkv, capacity, D]``, head-major; attention over rows ``0..row``), the row
        already counted. None where the fused step does not apply (the caller then writes and attends):
        not float32 on the CPU, a sliding window, APE tempering, or a row the new position must not see."""
        if (
            self.temper is not None
            or self.windows[layer] is not None
            or self._k.dtype != torch.float32
            or self._k.device.type != "cpu"
        ):
            return None
        if int(positions[0]) < self._max_pos[layer]:
            return None
        s = self._append(layer, positions[:1])
        return self._k[layer], self._v[layer], s, self.scale

    def attend(self, layer, q, q_pos):
        n = self._len[layer]
        if self.temper is not None:
            k, v, pos = self.layer_kv(layer)
            return explicit_attention(q, k, v, q_pos, pos, self.scale, self.windows[layer], self.temper)[0]
        window = self.windows[layer]
        k = self._k[layer, :, :n].unsqueeze(0)  # [1, Hkv, n, D]: each head's rows contiguous
        v = self._v[layer, :, :n].unsqueeze(0)
        mask = None
        low = int(q_pos[0]) if q_pos.numel() == 1 else int(q_pos.min())
        if window is not None or low < self._max_pos[layer]:  # some row hidden from some query
            mask = position_mask(q_pos, self._pos[layer, :n], window)
        hq, hkv = q.shape[1], k.shape[1]
        if mask is None and q.shape[0] == 1 and hq != hkv:
            # one query row seeing every row (a decode step): a KV head's query heads as the rows of one
            # query, so each head's K/V are read once, not once per query head (GQA's whole point)
            out = F.scaled_dot_product_attention(
                q[0].reshape(hkv, hq // hkv, -1)[None], k, v, scale=self.scale
            )
            return out.reshape(1, hq, -1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k,
            v,
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0].transpose(0, 1)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self._len[layer]
        return (
            self._k[layer, :, :n].transpose(0, 1),
            self._v[layer, :, :n].transpose(0, 1),
            self._pos[layer, :n],
        )

    @property
    def length(self) -> int:
        return self._len[-1]

    def nbytes(self) -> int:
        n = self.length
        return 2 * n * self._k.shape[1] * self._k.shape[3] * self._k.element_size() * self.num_layers
