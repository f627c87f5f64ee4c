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
    decode_weights: str | None = None,
) -> Model:
    """Load a Llama/Mistral/Qwen2 checkpoint: a model name, GGUF file, folder or hub id.

    ``decode_weights`` (None: ``$RAGKV_DECODE_WEIGHTS``, else ``"auto"``): what single-token decode
    steps run on, :func:`use_decode_weights`; prefill and every multi-row pass use the float32 (or
    ``dtype``) weights whatever it says."""
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
    use_decode_weights(model, folder, decode_weights)
    log.info(
        "loaded %s (%s, %d layers) fingerprint %s, decode weights %s",
        path_or_id,
        cfg.model_type,
        cfg.num_layers,
        fp[:12],
        model.decode_weights,
    )
    return model


#: opt-in weight-only quantized decode of any checkpoint (the weights quantized at load)
QUANTIZED_DECODE = ("q8_0", "q4_1", "q4_0")


def resolve_decode_weights(decode_weights: str | None) -> str:
    """A ``decode_weights`` setting: the argument, else ``$RAGKV_DECODE_WEIGHTS``, else the default."""
    from ragkv.model.lowbit import DECODE_WEIGHTS, DEFAULT_DECODE_WEIGHTS

    value = decode_weights or os.environ.get("RAGKV_DECODE_WEIGHTS") or DEFAULT_DECODE_WEIGHTS
    value = {"fp32": "float32", "q": "gguf"}.get(value, value)
    if value not in DECODE_WEIGHTS + QUANTIZED_DECODE:
        raise ValueError(f"unknown decode_weights {value!r}; use one of {DECODE_WEIGHTS + QUANTIZED_DECODE}")
    return value


def use_decode_weights(model: Model, folder: str | os.PathLike, decode_weights: str | None = None) -> str:
    """Set ``model``'s decode weights (:meth:`Model.set_decode_weights`) from checkpoint ``folder``:
    with ``"gguf"`` or ``"auto"``, the low-bit blocks of the GGUF file it was converted from, when
    that file is still there and the kernel builds; float32 otherwise (``"gguf"`` asked where it
    cannot run logs a warning; the model's ``decode_weights_note`` says why). Returns what runs."""
    from ragkv.model import lowbit_kernel
    from ragkv.model.gguf import gguf_source

    want = resolve_decode_weights(decode_weights)
    if want == "float32":
        return model.set_decode_weights(None)
    if want in QUANTIZED_DECODE:
        if lowbit_kernel.kernel() is None:
            note = f"the low-bit kernel is unavailable ({lowbit_kernel.kernel_error()})"
            log.warning("decode_weights=%r cannot run: %s; decode uses float32 weights", want, note)
            return model.set_decode_weights(None, note=note)
        return model.set_decode_weights(quantized_decode_weights(model, want.upper()), label=want)
    src = gguf_source(folder)
    if src is None:
        note = "the checkpoint is not a GGUF file (or its GGUF file moved)"
    elif model.device.type != "cpu":
        note = f"the low-bit kernel runs on the CPU; the model is on {model.device}"
    elif lowbit_kernel.kernel() is None:
        note = f"the low-bit kernel is unavailable ({lowbit_kernel.kernel_error()})"
    else:
        return model.set_decode_weights(cached_lowbit_weights(folder, src))
    if want == "gguf":
        log.warning("decode_weights='gguf' cannot run: %s; decode uses float32 weights", note)
    return model.set_decode_weights(None, note=note)


def quantized_decode_weights(model: Model, qtype: str = "Q8_0") -> dict:
    """``model``'s linear weights and LM head quantized into GGUF ``qtype`` blocks (Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0; by the ``gguf`` library) in the kernel's formats: weight-only low-bit decode for a
    checkpoint with no GGUF file (``decode_weights="q8_0"`` ...). Unlike ``"gguf"`` this changes the
    weights decode runs on (prefill keeps the checkpoint's); a weight whose rows are not a whole
    number of 32-value blocks is left out (it stays float32)."""
    from ragkv.model.lowbit import pack_gguf_tensor, quantize_to_gguf

    out = {}
    for name, w in hf_state_dict(model).items():
        if w.dim() != 2 or w.shape[1] % 32 or "norm" in name:
            continue
        out[name] = pack_gguf_tensor(quantize_to_gguf(w, qtype), qtype, int(w.shape[1]), source=qtype)
    return out


def cached_lowbit_weights(folder: str | os.PathLike, src: Path) -> dict:
    """The GGUF file's blocks in the kernel's formats (:func:`ragkv.model.lowbit.gguf_lowbit_weights`), kept
    beside the converted checkpoint (``<folder>/lowbit/``, not a ``*.safetensors`` of the folder, so
    the model's fingerprint is unchanged) and read from there on later loads."""
    from safetensors.torch import load_file, save_file

    from ragkv.model.lowbit import PACK_VERSION, LowBitTensor, gguf_lowbit_weights

    path = Path(folder) / "lowbit" / f"v{PACK_VERSION}.safetensors"
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as sf:
            meta = json.loads(sf.metadata()["tensors"])
        packed = load_file(str(path))
        return {n: LowBitTensor(m["fmt"], packed[n], m["n"], m["k"], m["source"]) for n, m in meta.items()}
    except (OSError, ValueError, KeyError, RuntimeError, TypeError):
        pass
    out = gguf_lowbit_weights(src)
    meta = {n: {"fmt": t.fmt, "n": t.n, "k": t.k, "source": t.source} for n, t in out.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({n: t.packed for n, t in out.items()}, str(tmp), metadata={"tensors": json.dumps(meta)})
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache only costs repacking on the next load
        log.info("could not keep the repacked decode weights in %s: %s", path.parent, e)
    return out


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
