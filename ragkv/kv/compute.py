"""Prefill chunks alone (after BOS, per the chunk convention) and keep their KV."""

from __future__ import annotations

import torch

from ragkv.kv.chunk import ChunkKV


def chunk_start_pos(model) -> int:
    """Position of a chunk's first token in the chunk convention (1 after BOS, else 0)."""
    return 1 if model.config.bos_token_id is not None else 0


@torch.inference_mode()
def compute_chunk_kv(model, token_ids: list[int] | torch.Tensor) -> ChunkKV:
    """Prefill ``[BOS] + token_ids`` and return the chunk rows' pre-RoPE K and V."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if ids.numel() == 0:
        raise ValueError("cannot compute KV of an empty chunk")
    start = chunk_start_pos(model)
    full = torch.cat([torch.tensor([model.config.bos_token_id]), ids]) if start else ids
    model.check_length(int(full.numel()))
    _, k, v = model.forward(full.to(model.device), capture_kv=True)
    return ChunkKV(
        token_ids=ids.cpu(),
        k=k[:, start:].contiguous(),
        v=v[:, start:].contiguous(),
        start_pos=start,
        fingerprint=model.fingerprint,
    )
