"""What a prefill returns: the prompt's KV and the last token's logits (the decode loop's input).

Owned here, below both the prefill (:mod:`ragkv.blend`) and the decode loop (:mod:`ragkv.generate`),
so the decode loop does not import the prefill machinery."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ragkv.attention.dense import ContextTemper


@dataclass
class PromptKV:
    """The prompt's KV after prefill: post-RoPE K and V ``[L, N, Hkv, D]`` at ``positions [N]``."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    token_ids: torch.Tensor
    k_pre: torch.Tensor | None = None  # pre-RoPE K, kept only when asked (prefix-cache inserts)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [vocab] fp32, of the last prompt token
    kv: PromptKV
    stats: dict = field(default_factory=dict)
    attn_probs: list[torch.Tensor] | None = None  # per layer [P, Hq, N] for probe rows
    #: APE tempering the decode must keep applying to the reused rows (None: plain attention)
    temper: ContextTemper | None = None
    #: called by the decode loop with the generated token ids when the answer is complete: an exact
    #: prefill commits the answer's KV to the KV tree, so the next chat turn reuses it too
    on_finish: Callable[..., None] | None = None
