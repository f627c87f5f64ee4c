"""Layer-wise forward of Llama-family causal LMs (Llama, Mistral, Qwen2) in plain PyTorch.

Every step takes explicit rows and positions so a layer can run on any subset of the prompt's
tokens: the primitive that selective (HKVD) recompute needs. Weights use Hugging Face names.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ragkv.model import lowbit_kernel
from ragkv.model.chat import tokenizer_adds_bos
from ragkv.model.config import ModelConfig
from ragkv.model.forward import CapturePreRope, CausalKV, run_layers, window_attention
from ragkv.model.lowbit import fused_finish, fused_qkv
from ragkv.model.packed import PackedWeight, linear
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
        #: the same linear layers on the GGUF file's low-bit blocks (decode steps only; None: float32)
        self.qkv_q = self.o_q = self.gate_up_q = self.down_q = None
        #: the float32 weights packed for prefill's GEMMs (:mod:`ragkv.model.packed`; None: plain)
        self.qkv_p, self.o_p = PackedWeight(self.qkv_w), PackedWeight(self.o_w)
        self.gate_up_p, self.down_p = PackedWeight(self.gate_up_w), PackedWeight(self.down_w)


class DecodeModel:
    """A :class:`Model` as single-token decode steps run it: its linear layers and LM head on the
    low-bit weights (:meth:`Model.set_decode_weights`); everything else is the model's own. Only
    :meth:`Model.decoder` makes one; multi-row passes never see it."""

    def __init__(self, model: Model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def qkv(self, layer: int, h: torch.Tensor):
        return self.model.qkv(layer, h, lowbit=True)

    def finish_layer(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        return self.model.finish_layer(layer, h, attn_out, lowbit=True)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.logits(h, lowbit=True)

    def fused_attention(self, kv, layer: int, q, k, v, positions, tables) -> torch.Tensor | None:
        """One decode row's RoPE, K/V write and attention in one kernel call, where ``kv`` offers a slot
        (:meth:`ragkv.attention.kvcache.DenseKVCache.decode_slot`); the RoPE rounds as :meth:`rope` does.
        None (nothing written): the caller rotates, writes and attends."""
        d = q.shape[-1]
        if (
            tables is None
            or q.dtype != torch.float32
            or tables[0].dtype != torch.float32
            or d % 16
            or d > 128
        ):
            return None
        slot_of = getattr(kv, "decode_slot", None)
        slot = slot_of(layer, positions) if slot_of is not None else None
        if slot is None:
            return None
        kc, vc, row, scale = slot
        return lowbit_kernel.kernel().decode_attention(q, k, v, tables[0], tables[1], kc, vc, row, scale)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, tables=None) -> torch.Tensor:
        """RoPE in one kernel call, rounded exactly as :meth:`Model.rope` (a float32 decode row)."""
        if tables is None or x.dtype != torch.float32 or tables[0].dtype != torch.float32:
            return self.model.rope(x, positions, tables)
        return lowbit_kernel.kernel().rope_rows(x, tables[0], tables[1])


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
        #: the GEMM prefill's linear layers run on (results differ in the last bits: the KV tree's root
        #: names it): "onednn-packed" or "aten"
        self.gemm = "onednn-packed" if self.layers and self.layers[0].qkv_p.packed is not None else "aten"
        inv, scaling = rope_frequencies(config.hf_config, config.head_dim)
        self.rotary = Rotary(inv.to(self.device), scaling)
        self.scale = config.head_dim**-0.5
        #: set by the correctness gate (ragkv.blend.gate); False disables chunk-KV reuse
        self.blend_ok: bool | None = None
        #: which weights single-token decode steps run on: "float32" or "gguf" (:meth:`decoder`)
        self.decode_weights = "float32"
        #: why decode runs on float32 weights where low-bit ones were asked for ("" otherwise)
        self.decode_weights_note = ""
        self.lm_head_q = None
        self._decoder: DecodeModel | None = None

    # ---- decode weights ---------------------------------------------------------------------
    def set_decode_weights(self, tensors: dict | None, note: str = "", label: str = "gguf") -> str:
        """Decode steps on low-bit weights: ``tensors`` maps Hugging Face weight names to
        :class:`~ragkv.model.lowbit.LowBitTensor` (the GGUF file's blocks, :func:`ragkv.model.lowbit.
        gguf_lowbit_weights`); None (or an empty dict) keeps float32 weights, with ``note`` saying why.
        ``label`` names them in stats (``"gguf"``: the file's own blocks; ``"q8_0"`` ...: weights
        quantized at load). A linear layer any of whose parts has no low-bit form keeps float32. Multi-row
        passes (prefill, chunk KV, the blend) never change: only :meth:`decoder` reads these.
        Returns the decode weights now in use."""
        from ragkv.model.lowbit import LowBitLinear

        def lin(names):
            parts = [tensors.get(n) for n in names]
            return LowBitLinear(parts) if all(p is not None for p in parts) else None

        for lw in self.layers:
            lw.qkv_q = lw.o_q = lw.gate_up_q = lw.down_q = None
        self.lm_head_q = None
        self.decode_weights, self.decode_weights_note = "float32", note
        if tensors:
            for i, lw in enumerate(self.layers):
                a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
                lw.qkv_q = lin([f"{a}{p}_proj.weight" for p in "qkv"])
                lw.o_q = lin([a + "o_proj.weight"])
                lw.gate_up_q = lin([m + "gate_proj.weight", m + "up_proj.weight"])
                lw.down_q = lin([m + "down_proj.weight"])
            tied = self.lm_head_w is self.embed_w
            self.lm_head_q = lin(["model.embed_tokens.weight" if tied else "lm_head.weight"])
            self.decode_weights, self.decode_weights_note = label, ""
        self._decoder = DecodeModel(self) if self.decode_weights != "float32" else None
        return self.decode_weights

    def decoder(self):
        """The model as single-token decode steps run it (:func:`ragkv.generate.decode_step`, the
        engine's batched decode): itself on float32 weights, else a view whose linear layers and LM
        head read the low-bit weights. The one switch every surface decodes through."""
        return self._decoder if self._decoder is not None else self

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (linear layers and LM head; embeddings and norms
        aside): the low-bit blocks where they are used, float32 elsewhere."""
        total = 0
        for lw in self.layers:
            for q, w in (
                (lw.qkv_q, lw.qkv_w),
                (lw.o_q, lw.o_w),
                (lw.gate_up_q, lw.gate_up_w),
                (lw.down_q, lw.down_w),
            ):
                use = q if self.decode_weights != "float32" else None
                total += use.nbytes if use is not None else w.numel() * w.element_size()
        q = self.lm_head_q if self.decode_weights != "float32" else None
        return total + (q.nbytes if q is not None else self.lm_head_w.numel() * self.lm_head_w.element_size())

    # ---- primitives -------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids.to(self.device), self.embed_w)

    def qkv(
        self, layer: int, h: torch.Tensor, lowbit: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-RoPE ``q [n,Hq,D]``, ``k [n,Hkv,D]``, ``v [n,Hkv,D]`` of rows ``h [n, hidden]``
        (``lowbit``: on the low-bit weights where set, as :meth:`decoder` runs it)."""
        c = self.config
        lw = self.layers[layer]
        out = None
        if lowbit and lw.qkv_q is not None:
            out = fused_qkv(h, lw.in_norm, c.rms_norm_eps, lw.qkv_q, lw.qkv_b)
            if out is None:
                out = lw.qkv_q(rms_norm(h, lw.in_norm, c.rms_norm_eps), lw.qkv_b).to(h.dtype)
        if out is None:
            out = linear(rms_norm(h, lw.in_norm, c.rms_norm_eps), lw.qkv_w, lw.qkv_p, lw.qkv_b)
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = out[:, :nq].view(-1, c.num_heads, c.head_dim)
        k = out[:, nq : nq + nk].view(-1, c.num_kv_heads, c.head_dim)
        v = out[:, nq + nk :].reshape(-1, c.num_kv_heads, c.head_dim)
        return q, k, v

    def finish_layer(
        self, layer: int, h: torch.Tensor, attn_out: torch.Tensor, lowbit: bool = False
    ) -> torch.Tensor:
        """o-proj + residual + MLP on rows ``h`` given their attention output ``[n,Hq,D]``."""
        c = self.config
        lw = self.layers[layer]
        if lowbit:
            return self._finish_lowbit(lw, h, attn_out)
        h = h + linear(attn_out.reshape(h.shape[0], -1), lw.o_w, lw.o_p, lw.o_b)
        x = rms_norm(h, lw.post_norm, c.rms_norm_eps)
        gate, up = linear(x, lw.gate_up_w, lw.gate_up_p).chunk(2, dim=-1)
        return h + linear(F.silu(gate) * up, lw.down_w, lw.down_p)

    def _finish_lowbit(self, lw: LayerWeights, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if lw.o_q is not None and lw.gate_up_q is not None and lw.down_q is not None:
            out = fused_finish(h, attn_out, lw.o_q, lw.o_b, lw.post_norm, eps, lw.gate_up_q, lw.down_q)
            if out is not None:
                return out
        a = attn_out.reshape(h.shape[0], -1)
        o = lw.o_q(a, lw.o_b).to(h.dtype) if lw.o_q is not None else F.linear(a, lw.o_w, lw.o_b)
        h = h + o
        x = rms_norm(h, lw.post_norm, self.config.rms_norm_eps)
        gu = lw.gate_up_q(x).to(h.dtype) if lw.gate_up_q is not None else F.linear(x, lw.gate_up_w)
        gate, up = gu.chunk(2, dim=-1)
        y = F.silu(gate) * up
        return h + (lw.down_q(y).to(h.dtype) if lw.down_q is not None else F.linear(y, lw.down_w))

    def logits(self, h: torch.Tensor, lowbit: bool = False) -> torch.Tensor:
        """Final norm + LM head of rows ``h`` -> ``[n, vocab]``."""
        x = rms_norm(h, self.final_norm, self.config.rms_norm_eps)
        if lowbit and self.lm_head_q is not None:
            return self.lm_head_q(x)
        return F.linear(x, self.lm_head_w)

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
