"""Rotary position embedding at explicit positions (any token may sit at any position).

Frequencies come from transformers' own RoPE initialisers so that every scaling variant
(linear, llama3, yarn) matches the reference model; the rotation itself is the
half-split ("NeoX") form that Hugging Face checkpoints of Llama/Mistral/Qwen2 use.
"""

from __future__ import annotations

import torch


class UnsupportedRopeError(ValueError):
    """A RoPE variant whose rotation depends on the sequence length, which breaks re-positioning."""


def rope_parameters(hf_config) -> dict:
    """The RoPE parameter dict of a transformers config (v4 ``rope_scaling`` or v5 ``rope_parameters``)."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def rope_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim/2]`` (fp32) and the attention scaling factor."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        theta = float(params["rope_theta"])
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    if rope_type == "dynamic":
        # Dynamic NTK changes frequencies with the sequence length, so a chunk's K computed at one
        # length is not a rotation of the same K at another: stored KV could never be re-positioned.
        raise UnsupportedRopeError("dynamic NTK RoPE scaling depends on sequence length; not supported")
    if rope_type == "longrope":
        # LongRoPE rotates with ``short_factor`` up to original_max_position_embeddings tokens and with
        # ``long_factor`` beyond (transformers picks per forward, by sequence length): a chunk's KV
        # computed alone (short) is not a rotation of the same chunk deep in a long prompt (long), and
        # one decode cache would need both. See docs/DEVIATIONS.md.
        raise UnsupportedRopeError(
            "longrope switches frequencies with the sequence length (short_factor / long_factor), so "
            "stored chunk KV cannot be re-positioned exactly; not supported"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedRopeError(f"unknown rope_type {rope_type!r}")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv.float(), float(scaling)


class Rotary:
    """Applies RoPE to ``[n, heads, head_dim]`` tensors at positions ``[n]``."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0):
        self.inv_freq = inv_freq.float()
        self.scaling = scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[n, 1, head_dim]`` computed in fp32 then cast, as transformers does."""
        freqs = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scaling).to(dtype)
        sin = (emb.sin() * self.scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]

    def apply(self, x: torch.Tensor, positions: torch.Tensor, cos_sin=None) -> torch.Tensor:
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
