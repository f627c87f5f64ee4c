"""GGUF checkpoints as an input: dequantize once into a cached safetensors checkpoint folder.

A ``.gguf`` file (llama.cpp's format; quantized weights plus config, tokenizer and chat template
in its metadata) is converted to an ordinary Hugging Face folder under
``$RAGKV_CACHE_DIR/gguf/<sha256 of the file>/``: ``config.json``, the tokenizer files,
``generation_config.json`` and ``model.safetensors`` with float32 weights. From then on it loads
like any checkpoint, and stored KV is keyed by the *dequantized* weights' fingerprint.

Why this split (measured on SmolLM2-135M-Instruct Q4_1, 2-core machine): the ``gguf`` library
dequantizes all 272 tensors in 5.7 s, while transformers' GGUF model loader took 23.8 s and needs
``accelerate``; transformers is still used for the config and the tokenizer (it converts the GGUF
vocabulary, merges and chat template into a fast tokenizer), which ragkv takes from it anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("ragkv.model")

#: GGUF architectures ragkv's runtime implements (Mistral GGUFs are written as ``llama``)
GGUF_ARCHITECTURES = ("llama", "qwen2")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFError(ValueError):
    """A GGUF file ragkv cannot convert (unknown architecture, missing tensors, unreadable file)."""


def cache_root() -> Path:
    """ragkv's cache directory (``$RAGKV_CACHE_DIR``, default ``~/.cache/ragkv``)."""
    return Path(os.environ.get("RAGKV_CACHE_DIR") or Path.home() / ".cache" / "ragkv").expanduser()


def fingerprint_file(kind: str, fingerprint: str, directory: Path | None = None) -> Path:
    """``<directory>/<fingerprint>.json`` (default directory ``$RAGKV_CACHE_DIR/<kind>``), the name
    cleaned to 64 alphanumerics: where a per-model calibration is kept."""
    safe = "".join(ch for ch in fingerprint if ch.isalnum())[:64] or "unknown"
    return (directory or cache_root() / kind) / f"{safe}.json"


def write_json_atomic(path: Path, obj, indent: int | None = None) -> None:
    """``obj`` as JSON at ``path``, through a temp file and a rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(obj, indent=indent))
    os.replace(tmp, path)


def find_gguf(path: str | os.PathLike) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the only ``*.gguf`` in a folder without weights."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p
    if p.is_dir() and not any(p.glob("*.safetensors")):
        files = sorted(p.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
        if len(files) > 1:
            raise GGUFError(f"{p} holds several GGUF files ({', '.join(f.name for f in files)}); pass one")
    return None


def file_digest(path: Path) -> str:
    """sha256 of a file, cached by (path, size, mtime) so large files are hashed once."""
    st = path.stat()
    cache_file = cache_root() / "digests.json"
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if ident in cache:
        return cache[ident]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    cache[ident] = digest
    with contextlib.suppress(OSError):  # a read-only cache only costs hashing again
        write_json_atomic(cache_file, cache)
    return digest


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves each head's two RoPE halves)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def open_reader(path: Path):
    """``(reader, architecture, query heads, KV heads)`` of a GGUF file ragkv can run (else GGUFError)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; ragkv converts {GGUF_ARCHITECTURES}")
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    return reader, arch, n_head, int(_field(reader, f"{arch}.attention.head_count_kv", n_head))


def dequantized_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file, dequantized to float32 under its Hugging Face name."""
    import gguf

    reader, arch, n_head, n_kv = open_reader(path)
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        a = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)  # owned, writable
        m = _BLOCK.match(t.name)
        if m:
            layer, part, kind = m.groups()
            if part not in _LAYER_NAMES:
                raise GGUFError(f"unexpected tensor {t.name!r} in {path.name}")
            # llama.cpp permutes q/k of Llama-style (interleaved-RoPE) models only; Qwen2 is NEOX-style
            if arch == "llama" and part in ("attn_q", "attn_k"):
                a = _unpermute(a, n_head if part == "attn_q" else n_kv)
            name = f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        else:
            base, _, kind = t.name.rpartition(".")
            if base not in _GLOBAL_NAMES:
                raise GGUFError(f"unexpected tensor {t.name!r} in {path.name}")
            name = f"{_GLOBAL_NAMES[base]}.{kind}"
        out[name] = torch.from_numpy(np.ascontiguousarray(a))
    if "model.embed_tokens.weight" not in out:
        raise GGUFError(f"{path.name} has no token embedding")
    return out


def _hf_name(t, arch: str, path: Path) -> tuple[str, str]:
    """``(Hugging Face name, GGUF part)`` of a GGUF tensor."""
    m = _BLOCK.match(t.name)
    if m:
        layer, part, kind = m.groups()
        if part not in _LAYER_NAMES:
            raise GGUFError(f"unexpected tensor {t.name!r} in {path.name}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}", part
    base, _, kind = t.name.rpartition(".")
    if base not in _GLOBAL_NAMES:
        raise GGUFError(f"unexpected tensor {t.name!r} in {path.name}")
    return f"{_GLOBAL_NAMES[base]}.{kind}", base


def gguf_source(folder: str | os.PathLike) -> Path | None:
    """The GGUF file a converted checkpoint folder was made from (its ``source.json``), if it is still
    there unchanged; None otherwise."""
    try:
        src = json.loads((Path(folder) / "source.json").read_text())
    except (OSError, ValueError):
        return None
    p = Path(src.get("gguf", ""))
    if not p.is_file() or file_digest(p) != src.get("sha256"):
        return None
    return p


def convert_gguf(path: str | os.PathLike, cache_dir: Path | None = None) -> Path:
    """Convert a GGUF file once; returns the cached checkpoint folder (reused while the file is unchanged)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    src = Path(path).expanduser().resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {src} not found")
    digest = file_digest(src)
    dest = (cache_dir or cache_root() / "gguf") / digest[:24]
    if (dest / "model.safetensors").is_file() and (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s (GGUF) into %s", src, dest)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    try:
        try:
            cfg = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
            tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        except Exception as e:  # transformers' GGUF metadata readers raise many kinds of errors
            raise GGUFError(f"cannot read the config/tokenizer of {src}: {e}") from e
        weights = dequantized_weights(src)
        if getattr(cfg, "tie_word_embeddings", False) or "lm_head.weight" not in weights:
            cfg.tie_word_embeddings = "lm_head.weight" not in weights
        cfg.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        GenerationConfig(
            bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=tok.pad_token_id
        ).save_pretrained(tmp)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "source.json").write_text(json.dumps({"gguf": str(src), "sha256": digest}, indent=1))
        try:
            os.replace(tmp, dest)  # atomic: a reader sees no folder or a whole one
        except OSError:  # another process converted it first (or dest is a stale partial copy)
            if not (dest / "model.safetensors").is_file():
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
