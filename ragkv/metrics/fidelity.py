"""How far a reused-KV prefill is from a full prefill."""

from __future__ import annotations

import torch


def first_token_kl(full_logits: torch.Tensor, other_logits: torch.Tensor) -> float:
    """KL(P_full || P_other) of the first generated token's distribution (nats)."""
    lp = torch.log_softmax(full_logits.float().flatten(), -1)
    lq = torch.log_softmax(other_logits.float().flatten(), -1)
    return float((lp.exp() * (lp - lq)).sum().clamp_min(0.0))


def first_token_agreement(full_logits: torch.Tensor, other_logits: torch.Tensor) -> bool:
    """Whether both prefills pick the same greedy first token."""
    return int(full_logits.argmax()) == int(other_logits.argmax())


def attention_deviation(full_probs: list[torch.Tensor], other_probs: list[torch.Tensor]) -> list[float]:
    """Per-layer L2 norm of the difference of the suffix rows' attention (the paper's Δattn)."""
    if len(full_probs) != len(other_probs):
        raise ValueError("attention captures of different depth")
    return [float((a.float() - b.float()).norm()) for a, b in zip(full_probs, other_probs, strict=True)]
