"""Model configuration: the few numbers our forward needs, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family causal LM that ragkv's runtime implements."""


@dataclass(frozen=True)
class ModelConfig:
    """What the layer-wise forward needs, independent of the transformers version."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    hf_config: Any = field(default=None, compare=False, repr=False)

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: Any, extra_eos_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Build from a ``transformers.PretrainedConfig`` (Llama, Mistral or Qwen2); ``extra_eos_ids``
        adds stop tokens from ``generation_config.json``."""
        mt = getattr(hf, "model_type", None)
        if mt not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {mt!r} is not supported; ragkv's runtime implements {SUPPORTED_ARCHITECTURES}"
            )
        act = getattr(hf, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (Llama-family models use silu)")
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        if mt == "qwen2":
            qkv_bias = True
            sw = hf.sliding_window if getattr(hf, "use_sliding_window", False) else None
        else:
            qkv_bias = bool(getattr(hf, "attention_bias", False))
            sw = getattr(hf, "sliding_window", None)
        if getattr(hf, "mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        eos_ids = tuple(dict.fromkeys(eos_ids + tuple(extra_eos_ids)))
        return cls(
            model_type=mt,
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=hf.vocab_size,
            max_position=hf.max_position_embeddings,
            rms_norm_eps=hf.rms_norm_eps,
            qkv_bias=qkv_bias,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_window=sw,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            hidden_act=act,
            hf_config=hf,
        )
