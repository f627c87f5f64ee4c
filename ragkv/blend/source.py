"""Where the blender gets the stored KV of cached prompt rows, one layer at a time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch


class KVPiece(Protocol):
    """A run of consecutive cached prompt rows whose pre-RoPE K/V can be read per layer."""

    @property
    def num_tokens(self) -> int: ...

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class ChunkKVAdapter(Protocol):
    """What the blend reads of an adapter (:class:`ragkv.adapter.kv_adapter.KVAdapter`, the chunk-KV
    writer :class:`ragkv.adapter.writer.WriterLoRA`): declared here, below both, so that the blend and
    the plan ask the adapter itself instead of guessing from its type."""

    #: its name in reports, plans and stored keys
    identity: str
    #: True for a writer: the stored chunk KV is its own (a store of its own), read as stored
    writes_kv: bool

    def kv_fingerprint(self, base) -> str:
        """The fingerprint stored chunk KV must carry to be read with this adapter over ``base``."""
        ...

    def wrap_source(self, source, start: int):
        """``source`` with this adapter applied to the reused rows, which begin at prompt row ``start``."""
        ...


#: ``transform(layer, k, v) -> (k, v)``: what a source applies to every layer it reads (a KV adapter)
RowsTransform = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def apply_transform(
    transform: RowsTransform | None, layer: int, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``transform``'s rows of a layer (the rows themselves without one)."""
    return (k, v) if transform is None else transform(layer, k, v)


class LayerSource:
    """Concatenates the pieces' K/V of a layer, in prompt order, on the model's device.

    This is the sequential source; ``ragkv.blend.pipeline.PipelinedSource`` prefetches layer
    ``l+1`` while layer ``l`` is being recomputed and has the same interface. ``transform`` (None:
    none) is applied to each layer where it is read: on the loader thread of a pipelined source, so a
    KV adapter's correction overlaps the blender's compute instead of adding to it.
    """

    def __init__(self, pieces: list[KVPiece], device: torch.device | str, dtype: torch.dtype):
        self.pieces = pieces
        self.device = device
        self.dtype = dtype
        self.wait_s = 0.0  # time the blender spent blocked on loads
        self.transform: RowsTransform | None = None

    def _read(self, layer: int, transform: RowsTransform | None) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = zip(*(p.layer_kv(layer) for p in self.pieces), strict=True)
        k = torch.cat(ks) if len(ks) > 1 else ks[0]
        v = torch.cat(vs) if len(vs) > 1 else vs[0]
        return apply_transform(transform, layer, k.to(self.device, self.dtype), v.to(self.device, self.dtype))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        out = self._read(layer, self.transform)
        self.wait_s += time.perf_counter() - t0
        return out

    def close(self) -> None:
        pass
