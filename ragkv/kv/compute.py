"""Prefill chunks alone (after BOS, per the chunk convention) and keep their KV."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragkv.kv.chunk import ChunkKV
from ragkv.model.forward import chunk_kv_tensors


@torch.inference_mode()
def compute_chunk_kv(
    model, token_ids: list[int] | torch.Tensor, fingerprint: str | None = None, context: Sequence[int] = ()
) -> ChunkKV:
    """Prefill ``[BOS] + token_ids`` and return the chunk rows' pre-RoPE K and V.

    ``model`` is any layer model (ragkv's, or the vLLM adapter, which has no fingerprint of its own:
    the caller passes the served checkpoint's ``fingerprint``). ``context``: token ids prefilled
    between BOS and the chunk (a context-primed chunk, issue 38's measurements; not the stored
    convention), cut from the front to fit the model's context.
    """
    if len(context):
        room = model.config.max_position - len(token_ids) - 1
        context = list(context)[-room:] if room > 0 else []
    ids, k, v, start = chunk_kv_tensors(model, token_ids, context)
    fp = model.fingerprint if fingerprint is None else fingerprint
    return ChunkKV(token_ids=ids, k=k, v=v, start_pos=start, fingerprint=fp)
