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
    sliding_window: int | None  # the window of the layers that slide (None: no layer slides)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    #: o_proj has a bias (Llama ``attention_bias=True``: q/k/v *and* o)
    o_bias: bool = False
    #: per layer, its sliding window or None (empty: every layer uses ``sliding_window``)
    layer_windows: tuple[int | None, ...] = ()
    hf_config: Any = field(default=None, compare=False, repr=False)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full causal attention)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Every layer's sliding window (None where a layer attends to everything before it)."""
        return self.layer_windows or (self.sliding_window,) * self.num_layers

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
        n_layers = hf.num_hidden_layers
        if mt == "qwen2":
            # q/k/v have biases, o_proj none; the window applies only to the layers that
            # ``layer_types`` marks "sliding_attention" (transformers: layers >= max_window_layers)
            qkv_bias, o_bias = True, False
            sw = hf.sliding_window if getattr(hf, "use_sliding_window", False) else None
            types = getattr(hf, "layer_types", None)
            if types is None:
                mwl = getattr(hf, "max_window_layers", 0)
                types = [
                    "sliding_attention" if sw is not None and i >= mwl else "full_attention"
                    for i in range(n_layers)
                ]
            if len(types) != n_layers or any(t not in ("sliding_attention", "full_attention") for t in types):
                raise UnsupportedModelError(f"layer_types {types!r} is not supported")
            layer_windows = tuple(sw if t == "sliding_attention" else None for t in types)
        elif mt == "mistral":
            # transformers' Mistral slides every layer (it ignores layer_types)
            qkv_bias = o_bias = False
            sw = getattr(hf, "sliding_window", None)
            layer_windows = (sw,) * n_layers
        else:
            # transformers' Llama has no sliding window; attention_bias puts a bias on q, k, v and o
            qkv_bias = o_bias = bool(getattr(hf, "attention_bias", False))
            sw = None
            layer_windows = (None,) * n_layers
        if not any(w is not None for w in layer_windows):
            sw = None
        if getattr(hf, "mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        from ragkv.model.rope import rope_frequencies

        rope_frequencies(hf, head_dim)  # refuses length-dependent RoPE (longrope, dynamic) by name
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        eos_ids = tuple(dict.fromkeys(eos_ids + tuple(extra_eos_ids)))
        return cls(
            model_type=mt,
            num_layers=n_layers,
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
            o_bias=o_bias,
            layer_windows=layer_windows,
            hf_config=hf,
        )
