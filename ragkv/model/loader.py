"""Load a Llama-family checkpoint (local folder or hub id) into ragkv's runtime.

transformers supplies the config and tokenizer only; weights are read with safetensors and the
forward is ours (ragkv.model.llama).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from ragkv.model.config import ModelConfig
from ragkv.model.gguf import file_digest
from ragkv.model.llama import Model

log = logging.getLogger("ragkv.model")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def resolve_model_dir(path_or_id: str | os.PathLike) -> Path:
    """The checkpoint folder of a model name, GGUF file, local folder or hub id.

    A known name (``ragkv.model.registry``) is fetched and converted on first use; a ``.gguf``
    file (or a folder holding one and no safetensors) is converted once into ragkv's cache; a
    folder is used as is; anything else is a hub id downloaded (config, tokenizer, safetensors).
    """
    from ragkv.model import registry
    from ragkv.model.gguf import convert_gguf, find_gguf

    if registry.is_named(str(path_or_id)):
        return registry.pull(str(path_or_id))
    p = Path(path_or_id).expanduser()
    gguf_file = find_gguf(p)
    if gguf_file is not None:
        return convert_gguf(gguf_file)
    if p.is_dir():
        return p
    if p.exists():
        raise ValueError(f"{p} is a file but not a .gguf checkpoint; pass the model's folder or a GGUF file")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                str(path_or_id),
                allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken"],
            )
        )
    except Exception as e:  # offline, unknown repo, gated model ...
        raise FileNotFoundError(
            f"model {path_or_id!r} is neither a local folder nor a hub id that could be fetched: {e}"
        ) from e


def generation_eos_ids(folder: Path) -> tuple[int, ...]:
    """Stop tokens of ``generation_config.json`` (instruct models often end turns with a token that
    ``config.json`` does not name, e.g. ``<|im_end|>`` or ``<|eot_id|>``)."""
    try:
        eos = json.loads((Path(folder) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos) if isinstance(eos, list) else ()


def weights_digest(folder: Path) -> str:
    """Identity of a checkpoint folder's weights: sha256 over the sha256 of each safetensors file."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return hashlib.sha256("|".join(file_digest(f) for f in files).encode()).hexdigest()


def checkpoint_fingerprint(
    path_or_id: str | os.PathLike, dtype: str | torch.dtype, tokenizer_path: str | os.PathLike | None = None
) -> str:
    """The fingerprint ``load_model(path_or_id, dtype)`` would have, without loading the weights.

    Other serving engines (the vLLM plugin) use it to find the chunk KV ragkv stored for the same
    checkpoint and dtype, and never another's.
    """
    from transformers import AutoConfig, AutoTokenizer

    folder = resolve_model_dir(path_or_id)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(folder), generation_eos_ids(folder))
    tok_dir = resolve_model_dir(tokenizer_path) if tokenizer_path is not None else folder
    tok = AutoTokenizer.from_pretrained(tok_dir)
    return model_fingerprint(cfg, weights_digest(folder), parse_dtype(dtype), tokenizer_digest(tok))


def tensors_digest(weights: dict[str, torch.Tensor]) -> str:
    """sha256 of in-memory weights (for random-initialised models with no files)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    if tokenizer is None:
        return "none"
    vocab = tokenizer.get_vocab()
    blob = json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()
    return hashlib.sha256(blob + type(tokenizer).__name__.encode()).hexdigest()


def _jsonable(x):
    """``x`` with every value made JSON-serializable (tuples as lists, tensors and others by repr)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


def model_fingerprint(cfg: ModelConfig, weights_digest: str, dtype: torch.dtype, tok_digest: str) -> str:
    """Identity of (architecture, weights, dtype, tokenizer): KV from any other model is never reused."""
    arch = {
        k: getattr(cfg, k)
        for k in (
            "model_type",
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "rms_norm_eps",
            "qkv_bias",
            "o_bias",
            "sliding_window",
            "bos_token_id",  # the row every chunk is computed after
            "tie_word_embeddings",
        )
    }
    arch["windows"] = list(cfg.windows)
    from ragkv.model.rope import rope_parameters

    # every RoPE parameter, lists (longrope factors) and nested values included
    arch["rope"] = _jsonable(rope_parameters(cfg.hf_config))
    payload = json.dumps(
        {"arch": arch, "weights": weights_digest, "dtype": str(dtype), "tok": tok_digest}, sort_keys=True
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def load_model(
    path_or_id: str | os.PathLike,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
) -> Model:
    """Load a Llama/Mistral/Qwen2 checkpoint: a model name, GGUF file, folder or hub id."""
    from safetensors import safe_open
    from transformers import AutoConfig

    dtype = parse_dtype(dtype)
    folder = resolve_model_dir(path_or_id)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(folder), generation_eos_ids(folder))
    digest = weights_digest(folder)  # FileNotFoundError when the folder holds no safetensors
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                weights[name] = sf.get_tensor(name).to(device=device, dtype=dtype)
    tokenizer = None
    if load_tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.model_max_length = 1 << 30  # ragkv checks lengths itself (PromptTooLongError)
    fp = model_fingerprint(cfg, digest, dtype, tokenizer_digest(tokenizer))
    model = Model(cfg, weights, tokenizer=tokenizer, fingerprint=fp, name=str(path_or_id))
    log.info("loaded %s (%s, %d layers) fingerprint %s", path_or_id, cfg.model_type, cfg.num_layers, fp[:12])
    return model


def random_hf_config(model_type: str = "llama", **overrides):
    """A small transformers config of the given architecture (defaults sized for fast tests)."""
    from transformers import AutoConfig

    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


def random_model(
    model_type: str = "llama",
    seed: int = 0,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    init_std: float = 0.02,
    **overrides,
) -> Model:
    """A random-initialised model of a given architecture (tests and benchmarks; no files)."""
    dtype = parse_dtype(dtype)
    hf = random_hf_config(model_type, **overrides)
    cfg = ModelConfig.from_hf(hf)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in random_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * init_std
        weights[name] = t.to(device=device, dtype=dtype)
    fp = model_fingerprint(cfg, tensors_digest(weights), dtype, "none")
    return Model(cfg, weights, tokenizer=None, fingerprint=fp, name=f"random-{model_type}-{seed}")


def random_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a Llama-family model."""
    d, hd = cfg.hidden_size, cfg.head_dim
    s: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, d),
        "model.norm.weight": (d,),
    }
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        s[p + "self_attn.q_proj.weight"] = (cfg.num_heads * hd, d)
        s[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * hd, d)
        s[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * hd, d)
        if cfg.qkv_bias:
            s[p + "self_attn.q_proj.bias"] = (cfg.num_heads * hd,)
            s[p + "self_attn.k_proj.bias"] = (cfg.num_kv_heads * hd,)
            s[p + "self_attn.v_proj.bias"] = (cfg.num_kv_heads * hd,)
        s[p + "self_attn.o_proj.weight"] = (d, cfg.num_heads * hd)
        if cfg.o_bias:
            s[p + "self_attn.o_proj.bias"] = (d,)
        s[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, d)
        s[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, d)
        s[p + "mlp.down_proj.weight"] = (d, cfg.intermediate_size)
        s[p + "input_layernorm.weight"] = (d,)
        s[p + "post_attention_layernorm.weight"] = (d,)
    return s


def hf_state_dict(model: Model) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (loads the same numbers into transformers: the
    exactness tests and the prefill benchmark's transformers baseline); the inverse of loading."""
    cfg = model.config
    w = {}
    w["model.embed_tokens.weight"] = model.embed_w
    w["model.norm.weight"] = model.final_norm
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = model.lm_head_w
    nq, nk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i, lw in enumerate(model.layers):
        p = f"model.layers.{i}.self_attn."
        for name, t in zip("qkv", lw.qkv_w.split([nq, nk, nk]), strict=True):
            w[f"{p}{name}_proj.weight"] = t
        if lw.qkv_b is not None:
            for name, t in zip("qkv", lw.qkv_b.split([nq, nk, nk]), strict=True):
                w[f"{p}{name}_proj.bias"] = t
        w[p + "o_proj.weight"] = lw.o_w
        if lw.o_b is not None:
            w[p + "o_proj.bias"] = lw.o_b
        p = f"model.layers.{i}."
        gate, up = lw.gate_up_w.chunk(2)
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = gate, up
        w[p + "mlp.down_proj.weight"] = lw.down_w
        w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"] = lw.in_norm, lw.post_norm
    return w
