"""Layer-wise forward of Llama-family causal LMs (Llama, Mistral, Qwen2) in plain PyTorch.

Every step takes explicit rows and positions so a layer can run on any subset of the prompt's
tokens: the primitive that selective (HKVD) recompute needs. Weights use Hugging Face names.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ragkv.model.chat import tokenizer_adds_bos
from ragkv.model.config import ModelConfig
from ragkv.model.forward import CapturePreRope, CausalKV, run_layers, window_attention
from ragkv.model.rope import Rotary, rope_frequencies


class PromptTooLongError(ValueError):
    """The prompt (plus requested new tokens) does not fit in the model's context."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as transformers' Llama does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LayerWeights:
    """One decoder layer's weights, with q/k/v and gate/up fused into single matmuls."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig):
        a = f"{prefix}.self_attn."
        self.qkv_w = torch.cat([w[f"{a}{p}_proj.weight"] for p in "qkv"])
        self.qkv_b = torch.cat([w[f"{a}{p}_proj.bias"] for p in "qkv"]) if cfg.qkv_bias else None
        self.o_w = w[a + "o_proj.weight"]
        self.o_b = w[a + "o_proj.bias"] if cfg.o_bias else None
        m = f"{prefix}.mlp."
        self.gate_up_w = torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]], 0)
        self.down_w = w[m + "down_proj.weight"]
        self.in_norm = w[f"{prefix}.input_layernorm.weight"]
        self.post_norm = w[f"{prefix}.post_attention_layernorm.weight"]


class Model:
    """A loaded causal LM whose forward can be driven layer by layer on selected rows."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        tokenizer=None,
        fingerprint: str = "",
        name: str = "",
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.name = name
        w = {k.removeprefix("model."): v for k, v in weights.items()}
        self.embed_w = w["embed_tokens.weight"]
        self.dtype = self.embed_w.dtype
        self.device = self.embed_w.device
        self.layers = [LayerWeights(w, f"layers.{i}", config) for i in range(config.num_layers)]
        self.final_norm = w["norm.weight"]
        lm = w.get("lm_head.weight")
        self.lm_head_w = self.embed_w if (lm is None or config.tie_word_embeddings) else lm
        inv, scaling = rope_frequencies(config.hf_config, config.head_dim)
        self.rotary = Rotary(inv.to(self.device), scaling)
        self.scale = config.head_dim**-0.5
        #: set by the correctness gate (ragkv.blend.gate); False disables chunk-KV reuse
        self.blend_ok: bool | None = None

    # ---- primitives -------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids.to(self.device), self.embed_w)

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-RoPE ``q [n,Hq,D]``, ``k [n,Hkv,D]``, ``v [n,Hkv,D]`` of rows ``h [n, hidden]``."""
        c = self.config
        lw = self.layers[layer]
        x = rms_norm(h, lw.in_norm, c.rms_norm_eps)
        out = F.linear(x, lw.qkv_w, lw.qkv_b)
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = out[:, :nq].view(-1, c.num_heads, c.head_dim)
        k = out[:, nq : nq + nk].view(-1, c.num_kv_heads, c.head_dim)
        v = out[:, nq + nk :].reshape(-1, c.num_kv_heads, c.head_dim)
        return q, k, v

    def finish_layer(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o-proj + residual + MLP on rows ``h`` given their attention output ``[n,Hq,D]``."""
        c = self.config
        lw = self.layers[layer]
        h = h + F.linear(attn_out.reshape(h.shape[0], -1), lw.o_w, lw.o_b)
        x = rms_norm(h, lw.post_norm, c.rms_norm_eps)
        gate, up = F.linear(x, lw.gate_up_w).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, lw.down_w)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head of rows ``h`` -> ``[n, vocab]``."""
        return F.linear(rms_norm(h, self.final_norm, self.config.rms_norm_eps), self.lm_head_w)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of ``positions`` in the model's dtype, shared by every layer of a forward."""
        return self.rotary.cos_sin(positions.to(self.device), self.dtype)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, tables=None) -> torch.Tensor:
        return self.rotary.apply(x, positions.to(self.device), tables)

    def attend(
        self, layer: int, q, k, v, q_pos, k_pos, contiguous: bool = False, position_blocks: int = 0
    ) -> torch.Tensor:
        """Attention of ``layer`` (its own sliding window) of post-RoPE ``q`` over ``k, v``."""
        return window_attention(self, layer, q, k, v, q_pos, k_pos, contiguous, position_blocks)

    def check_length(self, n_tokens: int, extra: int = 0) -> None:
        if n_tokens + extra > self.config.max_position:
            raise PromptTooLongError(
                f"prompt of {n_tokens} tokens (+{extra} new) exceeds the model's context of "
                f"{self.config.max_position} positions"
            )

    # ---- whole forward ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor | None = None, capture_kv: bool = False
    ):
        """Ordinary causal prefill of a contiguous sequence (:func:`ragkv.model.forward.run_layers`).

        Returns ``(logits [n, vocab], k_pre [L,n,Hkv,D] or None, v [L,n,Hkv,D] or None)``.
        """
        n = int(token_ids.numel())
        if positions is None:
            positions = torch.arange(n, device=self.device)
        positions = positions.to(self.device)
        self.check_length(int(positions.max()) + 1 if n else 0)
        cap = CapturePreRope() if capture_kv else None
        h, _ = run_layers(self, self.embed(token_ids), positions, CausalKV(self), on_pre_rope=cap)
        logits = self.logits(h)
        if cap is not None:
            return (logits, *cap.stacked())
        return logits, None, None

    def encode(self, text: str, add_bos: bool = False, specials: bool = False) -> list[int]:
        """Tokenize without adding special tokens; ``add_bos`` starts with BOS if the tokenizer would.

        A special token's text inside ``text`` (``<|im_end|>`` typed in a question or a document) is
        encoded as text, never as the control token; ``specials=True`` parses it, for text that is the
        model's raw input by contract (a rendered template, an OpenAI completions prompt)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids")
        ids = self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not specials)
        if add_bos and self.adds_bos:
            ids = [self.config.bos_token_id] + ids
        return ids

    @functools.cached_property
    def adds_bos(self) -> bool:
        """Whether a prompt starts with BOS: as the tokenizer itself does (ChatML tokenizers do not)."""
        return tokenizer_adds_bos(self.tokenizer, self.config.bos_token_id)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)
