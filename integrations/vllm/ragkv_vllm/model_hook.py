"""The model hook blending needs: reach vLLM's loaded model from the KV connector, and drive it layer by layer.

vLLM's connector API never hands the model to a connector (it is prefix-only: a connector reports how
many leading tokens it loaded). Selective recompute needs the model, so, as the workaround discussed
in LMCache#4131 (vLLM PR #37339 proposes a ``register_model`` connector hook; not in vLLM 0.32), the
``vllm.general_plugins`` entry point wraps ``GPUModelRunner.load_model`` (both the V1 runner and the
V2 ``vllm/v1/worker/gpu/model_runner.py`` one) so that, once the weights are loaded, the runner's
model is recorded here for the worker-side connector of the same process.

:class:`VllmLayerModel` exposes a vLLM Llama / Mistral / Qwen2 model through the primitives of
ragkv's own runtime (``embed``, ``qkv``, ``rope``, ``attend``, ``finish_layer``), so
:func:`ragkv_vllm.rows.blend_rows` and :func:`ragkv.model.forward.compute_chunk_kv` run unchanged on
vLLM's weights and kernels. Attention inside the blend is ragkv's dense attention over the gathered
rows, not vLLM's paged kernel (the blend's rows are scattered, which vLLM's kernels do not take).

This module imports vLLM only inside functions: ``checkpoint_fingerprint`` works without it.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

import torch

from ragkv.attention.dense import layer_windows
from ragkv.model.forward import LayerConfig, window_attention

log = logging.getLogger("vllm.ragkv")  # under vLLM's logger: shown in its log at INFO

SUPPORTED_MODELS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")
_HOOK_MARK = "_ragkv_load_model_hook"

_lock = threading.Lock()
_registered: dict[str, object] = {}


class UnsupportedVllmModelError(ValueError):
    """The served model is not one whose layers :class:`VllmLayerModel` can drive."""


class ModelNotRegisteredError(RuntimeError):
    """No vLLM model was recorded in this process (the plugin's load_model hook did not run)."""


# ---- registry ------------------------------------------------------------------------------------
def register_model(model, vllm_config=None) -> None:
    """Record the model runner's model for this process's worker-side connector."""
    with _lock:
        _registered["model"] = model
        _registered["vllm_config"] = vllm_config
        _registered.pop("layer_model", None)


def clear_registered_model() -> None:
    with _lock:
        _registered.clear()


def layer_model(
    bos_token_id: int | None, sliding_window: int | None | tuple[int | None, ...] = None
) -> VllmLayerModel:
    """The :class:`VllmLayerModel` over the recorded model (built once per registration)."""
    with _lock:
        cached = _registered.get("layer_model")
        model = _registered.get("model")
        cfg = _registered.get("vllm_config")
    if cached is not None:
        return cached
    if model is None:
        raise ModelNotRegisteredError(
            "no vLLM model registered in this process: is the ragkv vllm.general_plugins entry point "
            "installed (pip install ragkv[vllm]) and not filtered out by VLLM_PLUGINS?"
        )
    if cfg is not None:
        par = cfg.parallel_config
        if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
            # HKVD selection is per rank (each rank sees its own heads): ranks would select different
            # rows and their collectives would diverge. Refuse rather than hang.
            raise UnsupportedVllmModelError(
                "ragkv blending needs tensor_parallel_size=1 and pipeline_parallel_size=1"
            )
    lm = VllmLayerModel(model, bos_token_id=bos_token_id, sliding_window=sliding_window)
    with _lock:
        _registered["layer_model"] = lm
    return lm


# ---- the load_model hook ------------------------------------------------------------------------
def _wrap_load_model(original):
    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        try:
            register_model(self.get_model(), getattr(self, "vllm_config", None))
        except Exception as e:  # never break model loading because of ragkv
            log.warning(
                "ragkv: could not record the loaded model (%s: %s); blending disabled", type(e).__name__, e
            )
        return out

    setattr(load_model, _HOOK_MARK, True)
    return load_model


def install_load_model_hook() -> list[str]:
    """Wrap ``GPUModelRunner.load_model`` in every runner module that imports; idempotent.

    Returns the patched ``module.Class`` names (empty when vLLM's GPU runners cannot be imported).
    """
    import importlib

    patched = []
    for modname in _RUNNER_MODULES:
        try:
            mod = importlib.import_module(modname)
        except Exception as e:  # an absent or broken runner module: nothing to hook there
            log.debug("ragkv: %s not importable (%s)", modname, e)
            continue
        cls = getattr(mod, "GPUModelRunner", None)
        if cls is None or not hasattr(cls, "load_model"):
            continue
        if not getattr(cls.load_model, _HOOK_MARK, False):
            cls.load_model = _wrap_load_model(cls.load_model)
        patched.append(f"{modname}.GPUModelRunner")
    return patched


# ---- the layer model ----------------------------------------------------------------------------
class VllmLayerModel:
    """A vLLM Llama/Mistral/Qwen2 model driven layer by layer on arbitrary rows (ragkv's primitives).

    The residual stream is carried as one tensor ``h`` (vLLM fuses the residual add into its norms;
    the sums are the same). RoPE uses the layer's ``rotary_emb.forward_native`` (plain PyTorch, any
    device), so stored pre-RoPE K is rotated exactly as vLLM rotates fresh K.
    """

    def __init__(
        self,
        vllm_model,
        bos_token_id: int | None,
        sliding_window: int | None | tuple[int | None, ...] = None,
    ):
        name = type(vllm_model).__name__
        if name not in SUPPORTED_MODELS:
            raise UnsupportedVllmModelError(f"ragkv blending supports {SUPPORTED_MODELS}, not {name}")
        inner = vllm_model.model
        layers = list(inner.layers)
        if getattr(inner, "start_layer", 0) != 0 or getattr(inner, "end_layer", len(layers)) != len(layers):
            raise UnsupportedVllmModelError("pipeline-parallel models are not supported")
        for lyr in layers:
            if getattr(lyr.self_attn, "do_llama_4_scaling", False) or getattr(
                lyr, "ada_rms_norm_t_cond", None
            ):
                raise UnsupportedVllmModelError(
                    f"{name} with llama-4 attention scaling or ada-RMSNorm is not supported"
                )
        a0 = layers[0].self_attn
        self.inner = inner
        self.layers = layers
        self.config = LayerConfig(
            num_layers=len(layers),
            num_heads=a0.num_heads,
            num_kv_heads=a0.num_kv_heads,
            head_dim=a0.head_dim,
            bos_token_id=bos_token_id,
            layer_windows=layer_windows(sliding_window, len(layers)),
        )
        self.scale = float(a0.scaling)
        w = inner.embed_tokens.weight
        self.device = w.device
        self.dtype = w.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_input_ids(token_ids.to(self.device))

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-RoPE ``q [n,Hq,D]``, ``k, v [n,Hkv,D]`` of rows ``h``."""
        lyr = self.layers[layer]
        att = lyr.self_attn
        x = lyr.input_layernorm(h)
        out, _ = att.qkv_proj(x)
        q, k, v = out.split([att.q_size, att.kv_size, att.kv_size], dim=-1)
        c = self.config
        return (
            q.reshape(-1, c.num_heads, c.head_dim),
            k.reshape(-1, c.num_kv_heads, c.head_dim),
            v.reshape(-1, c.num_kv_heads, c.head_dim),
        )

    def rope_tables(self, positions: torch.Tensor) -> None:
        return None  # vLLM's rotary embedding caches its own cos/sin

    def rope(self, x: torch.Tensor, positions: torch.Tensor, tables=None) -> torch.Tensor:
        """``x [n,H,D]`` rotated at ``positions`` by the model's rotary embedding."""
        n = x.shape[0]
        if n == 0:
            return x
        rot = self.layers[0].self_attn.rotary_emb
        out, _ = rot.forward_native(positions.to(self.device), x.reshape(n, -1).contiguous(), None)
        return out.reshape(x.shape)

    def attend(
        self, layer: int, q, k, v, q_pos, k_pos, contiguous: bool = False, position_blocks: int = 0
    ) -> torch.Tensor:
        """Attention of ``layer`` (its sliding window): ragkv's dense attention over the given rows."""
        return window_attention(self, layer, q, k, v, q_pos, k_pos, contiguous, position_blocks)

    def finish_layer(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o-proj + residual + MLP of rows ``h`` given their attention output ``[n,Hq,D]``."""
        lyr = self.layers[layer]
        o, _ = lyr.self_attn.o_proj(attn_out.reshape(h.shape[0], -1))
        h = h + o
        return h + lyr.mlp(lyr.post_attention_layernorm(h))


# ---- fingerprint of the served checkpoint -------------------------------------------------------
def checkpoint_fingerprint(
    model_path: str | Path, dtype: torch.dtype | str, tokenizer_path: str | Path | None = None
) -> str:
    """ragkv's model fingerprint of the served checkpoint (see ``ragkv.model.checkpoint_fingerprint``)."""
    from ragkv.model.loader import checkpoint_fingerprint as fingerprint

    return fingerprint(model_path, dtype, tokenizer_path)


def served_bos_and_window(hf_config) -> tuple[int | None, tuple[int | None, ...]]:
    """BOS id and per-layer sliding windows of the served model, as ragkv's runtime reads them."""
    from ragkv.model.config import ModelConfig

    cfg = ModelConfig.from_hf(hf_config)
    return cfg.bos_token_id, cfg.windows
