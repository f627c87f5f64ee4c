"""Chunk KV: the per-layer keys and values of one retrieved chunk, prefilled alone.

Chunk convention (version ``CHUNK_CONVENTION_VERSION``), documented in docs/CHUNK_CONVENTION.md:

* A chunk is prefilled *alone*, right after the model's BOS token when the tokenizer has one
  (BOS sits at position 0 and the chunk at positions ``1..T``); without a BOS the chunk starts at 0.
  BOS is there so that the chunk's first token does not become an attention sink; its KV row is
  dropped (the real prompt carries its own BOS in its prefix).
* K is kept **pre-RoPE**. Re-positioning a chunk to offset ``m`` is then "apply RoPE at the new
  positions", which is exact for every RoPE variant (scaling included) and never double-rounds.
  Because rotations preserve norms, HKVD deviations measured pre- or post-RoPE are identical.
* Tensors are stacked over layers: ``k`` and ``v`` are ``[num_layers, T, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

CHUNK_CONVENTION_VERSION = 1
#: the fingerprint of a page of the exact KV tree starts with this (then the tree's root and the previous
#: page's key: :func:`ragkv.blend.kvtree.page_keys`), so its chunk key hashes the whole prefix
TREE_PAGE_PREFIX = "tree:"


class KVMismatchError(ValueError):
    """Stored KV does not belong to the model (or dtype, or convention) it is being used with."""


@dataclass
class ChunkKV:
    """KV of one chunk in the chunk convention above.

    ``start_pos`` is the position of the chunk's first token when it was prefilled (1 after BOS).
    ``fingerprint`` identifies the model (weights, dtype, tokenizer) that produced it.
    """

    token_ids: torch.Tensor  # long [T]
    k: torch.Tensor  # [L, T, Hkv, D], pre-RoPE
    v: torch.Tensor  # [L, T, Hkv, D]
    start_pos: int
    fingerprint: str
    convention: int = CHUNK_CONVENTION_VERSION
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def key(self) -> str:
        return chunk_key(self.token_ids.tolist(), self.fingerprint, self.convention)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE K and V ``[T, Hkv, D]`` of one layer (the blender's per-layer read)."""
        return self.k[layer], self.v[layer]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ChunkKV:
        return ChunkKV(
            token_ids=self.token_ids,
            k=self.k.to(device=device, dtype=dtype),
            v=self.v.to(device=device, dtype=dtype),
            start_pos=self.start_pos,
            fingerprint=self.fingerprint,
            convention=self.convention,
            meta=dict(self.meta),
        )

    def check_compatible(self, fingerprint: str, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """Raise :class:`KVMismatchError` unless this KV can be used with the given model."""
        if self.fingerprint != fingerprint:
            raise KVMismatchError(
                f"chunk KV was computed by model {self.fingerprint[:16]}..., not by this model "
                f"({fingerprint[:16]}...): refusing to reuse it"
            )
        if self.convention != CHUNK_CONVENTION_VERSION:
            raise KVMismatchError(
                f"chunk KV uses convention v{self.convention}, this ragkv uses v{CHUNK_CONVENTION_VERSION}"
            )
        want = (num_layers, self.num_tokens, num_kv_heads, head_dim)
        if tuple(self.k.shape) != want or tuple(self.v.shape) != want:
            raise KVMismatchError(f"chunk KV has shape {tuple(self.k.shape)}, model expects {want}")


def chunk_key(token_ids: list[int], fingerprint: str, convention: int = CHUNK_CONVENTION_VERSION) -> str:
    """Content key of a chunk: hash of its token ids, the model fingerprint and the convention."""
    h = hashlib.sha256()
    h.update(f"ragkv-chunk-v{convention}|{fingerprint}|".encode())
    h.update(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()
