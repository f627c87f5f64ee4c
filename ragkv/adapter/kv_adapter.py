"""A small learned correction of reused chunk KV (W-kv): stored K/V in, corrected K/V out, per layer.

The adapter maps each stored row's pre-RoPE ``[k; v]`` of a layer to ``(k + dK, v + dV)`` with
``dK = bias_k + up_k(down(x))`` (and alike for V), ``x`` the row's RMS-normalised ``[k; v]``. It is
trained by KL to full prefill (:mod:`ragkv.adapter.train`) and applied where stored chunk KV is *read*
for reuse (:class:`AdaptedRows`, through ``prefill(adapter=...)``), never where KV is written or computed, so:

* the user's model is unchanged, and so is full prefill;
* a row the blend recomputes gets fresh K/V (the adapter never touches it): ratio 1.0 equals full;
* stored KV is the plain chunk convention, with or without an adapter (one store serves both).

Deviation from the digest's W-kv (docs/DEVIATIONS.md): its input is the stored K/V (384 values per
row on the default model), not the k/v projection's input (576), so it needs no hidden states at
ingest and no new chunk convention; rank 0 is the "learned constant offset" check (d).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

FORMAT = "ragkv-kv-adapter/1"


class AdapterError(ValueError):
    """An adapter file that cannot be trusted or does not fit the model it is used with."""


@dataclass(frozen=True)
class AdapterSpec:
    """The shape of an adapter and the model it was trained for."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    rank: int
    model_fingerprint: str

    @property
    def width(self) -> int:
        return self.num_kv_heads * self.head_dim


class KVAdapter(nn.Module):
    """Per-layer bias + low-rank correction of stored pre-RoPE K and V (starts as the identity)."""

    #: it corrects stored KV where it is read; the KV it reads is the base model's
    writes_kv = False

    def kv_fingerprint(self, base) -> str:
        """The fingerprint of the chunk KV it reads: the base model's own (it writes none)."""
        return base.fingerprint

    def __init__(self, spec: AdapterSpec, seed: int = 0):
        super().__init__()
        self.spec = spec
        L, w, r = spec.num_layers, spec.width, spec.rank
        g = torch.Generator().manual_seed(seed)
        self.bias_k = nn.Parameter(torch.zeros(L, w))
        self.bias_v = nn.Parameter(torch.zeros(L, w))
        # up_* start at zero: an untrained adapter changes nothing
        self.down = nn.Parameter(torch.randn(L, 2 * w, max(r, 1), generator=g) / (2 * w) ** 0.5)
        self.up_k = nn.Parameter(torch.zeros(L, max(r, 1), w))
        self.up_v = nn.Parameter(torch.zeros(L, max(r, 1), w))
        if r == 0:
            for p in (self.down, self.up_k, self.up_v):
                p.requires_grad_(False)

    @classmethod
    def for_model(cls, model, rank: int = 16, seed: int = 0) -> KVAdapter:
        c = model.config
        spec = AdapterSpec(c.num_layers, c.num_kv_heads, c.head_dim, rank, model.fingerprint)
        return cls(spec, seed)

    def correct(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Corrected ``(k, v) [n, Hkv, D]`` of stored rows of ``layer`` (in their dtype): K and V side
        by side, so a layer is one normalisation and two small matmuls."""
        n, w = k.shape[0], self.spec.width
        x = torch.cat([k.reshape(n, w), v.reshape(n, w)], dim=-1).float()
        if self.bias_k.requires_grad:  # training: joined here, inside the autograd graph
            bias = torch.cat([self.bias_k[layer], self.bias_v[layer]])
            up = torch.cat([self.up_k[layer], self.up_v[layer]], dim=-1)
        else:  # a loaded adapter: joined once (eval.bench_adapter_time: the correction's cost)
            joined_bias, joined_up = self._joined()
            bias, up = joined_bias[layer], joined_up[layer]
        if self.spec.rank:
            # RMS-normalised rows times ``down``, the per-row scale applied to the rank-r product (the
            # same value; scaling [n, r] instead of [n, 2w]), the scale from one norm (one reduction)
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            z = (x @ self.down[layer]) * torch.rsqrt(norm.square() / (2 * w) + 1e-6)
            out = torch.addmm(bias, z, up).add_(x)  # in place: addmm's gradient needs its inputs only
        else:
            out = x + bias
        ck, cv = out.to(k.dtype).view(n, 2, *k.shape[1:]).unbind(1)  # views: no copy
        return ck, cv

    def _joined(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[bias_k | bias_v]`` and ``[up_k | up_v]`` per layer, joined once and again only after the
        parameters change (a frozen adapter's correction reads them)."""
        parts = (self.bias_k, self.bias_v, self.up_k, self.up_v)
        # the parameters' versions (bumped by every in-place change), device and dtype: never stale
        key = (*(t._version for t in parts), self.bias_k.device, self.bias_k.dtype)
        cache = getattr(self, "_joined_cache", None)
        if cache is None or cache[0] != key:
            with torch.no_grad():
                joined = (
                    torch.cat([self.bias_k, self.bias_v], dim=-1).contiguous(),
                    torch.cat([self.up_k, self.up_v], dim=-1).contiguous(),
                )
            self._joined_cache = (key, joined)
        return self._joined_cache[1]

    def wrap_source(self, source, start: int):
        """A blend's per-layer KV source whose rows from ``start`` on (the reused chunks, after any
        exact head) are read through this adapter: one correction per layer, not one per chunk. A
        source with a ``transform`` hook (``ragkv.blend.source.LayerSource``) corrects each layer where
        it reads it: on a pipelined source's loader thread, overlapping the blender's compute."""
        rows = AdaptedRows(self, start)
        if getattr(source, "transform", False) is None:
            source.transform = rows
            return source
        return AdaptedSource(source, rows)

    # ---- files ----------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        keys = ["bias_k", "bias_v"] + (["down", "up_k", "up_v"] if self.spec.rank else [])
        return {k: getattr(self, k).detach().float().contiguous().cpu() for k in keys}

    def save(self, path: str | Path, meta: dict | None = None) -> str:
        """Write the adapter (safetensors with its spec in the metadata); returns the file's sha256."""
        return write_adapter_file(path, FORMAT, self.spec.__dict__, self.state(), meta)

    @classmethod
    def load(cls, path: str | Path, model=None, digest: str | None = None) -> KVAdapter:
        """Read an adapter; refuses a file whose digest differs from ``digest``, a foreign format, a
        shape that does not fit, or (given ``model``) another model's adapter."""
        path = Path(path)

        def fits(spec: AdapterSpec, model) -> bool:
            c = model.config
            return (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (
                c.num_layers,
                c.num_kv_heads,
                c.head_dim,
            )

        return load_adapter_module(cls, path, FORMAT, AdapterSpec, digest, model, fits)

    @property
    def identity(self) -> str:
        """Short id for keys and reports: the digest of its tensors (the file's when loaded)."""
        return adapter_identity(self)


def adapter_identity(module) -> str:
    """Short id of an adapter (a module with ``state()``): its file's digest when loaded from one, else
    the digest of its tensors."""
    d = getattr(module, "digest", None)
    if d:
        return d[:16]
    h = hashlib.sha256()
    for k, t in sorted(module.state().items()):
        h.update(k.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def check_trained_for(model_fingerprint: str, model, path: Path) -> None:
    """Refuse an adapter file trained for another model than ``model``."""
    if model_fingerprint != model.fingerprint:
        raise AdapterError(
            f"adapter {path.name} was trained for model {model_fingerprint[:12]}, not {model.fingerprint[:12]}"
        )


def write_adapter_file(path: str | Path, fmt: str, spec: dict, tensors: dict, meta: dict | None) -> str:
    """An adapter as safetensors (``format``, ``spec`` and ``meta`` in its metadata), written through a
    temp file and a rename; returns its :func:`file_digest`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"format": fmt, "spec": json.dumps(spec), "meta": json.dumps(meta or {})}
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata=info)
    tmp.replace(path)
    return file_digest(path)


def read_adapter_file(
    path: Path, fmt: str, digest: str | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(spec, tensors)`` of an adapter file of format ``fmt``; refuses a missing, unreadable or foreign
    file and (given ``digest``) one whose content digest differs."""
    from safetensors import safe_open

    if not path.is_file():
        raise AdapterError(f"no adapter file at {path}")
    if digest is not None and file_digest(path) != digest:  # unreadable files raise here too
        raise AdapterError(f"adapter {path.name}: digest mismatch (edited, truncated or another file)")
    try:
        with safe_open(str(path), framework="pt") as f:
            info = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
        if info.get("format") != fmt:
            raise AdapterError(f"adapter {path.name}: not a {fmt} file (format {info.get('format')!r})")
        spec = json.loads(info["spec"])
    except AdapterError:
        raise
    except Exception as e:  # a corrupt header or body
        raise AdapterError(f"adapter {path.name}: unreadable ({e})") from e
    return spec, tensors


def load_adapter_module(cls, path: Path, fmt: str, spec_cls: type, digest: str | None, model, fits):
    """A ``cls`` module read from an adapter file of format ``fmt`` whose spec is a ``spec_cls``; given
    ``model``, refuses another model's file and one whose shape ``fits(spec, model)`` rejects. The
    module is frozen and carries the file's digest (:func:`fill_parameters`)."""
    spec_dict, tensors = read_adapter_file(path, fmt, digest)
    try:
        spec = spec_cls(**spec_dict)
    except TypeError as e:
        raise AdapterError(f"adapter {path.name}: unreadable spec ({e})") from e
    if model is not None:
        check_trained_for(spec.model_fingerprint, model, path)
        if not fits(spec, model):
            raise AdapterError(f"adapter {path.name}: shape does not fit the model")
    try:
        module = cls(spec)
    except ValueError as e:  # a spec the class refuses (a writer of rank 0)
        raise AdapterError(f"adapter {path.name}: {e}") from e
    fill_parameters(module, module.state(), tensors, path)
    return module


def adapter_format(path: str | Path) -> str | None:
    """The ``format`` an adapter file declares (None: unreadable or none)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("format")
    except Exception:
        return None


def fill_parameters(module: nn.Module, own: dict, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Copy a file's ``tensors`` into ``module``'s parameters (``own``: its state by name), refusing a
    set or shape that differs or a non-finite value; freezes the module and records the file's digest."""
    if set(tensors) != set(own) or any(tensors[k].shape != own[k].shape for k in own):
        raise AdapterError(f"adapter {path.name}: tensors do not match its spec")
    with torch.no_grad():
        for k, t in tensors.items():
            if not torch.isfinite(t).all():
                raise AdapterError(f"adapter {path.name}: non-finite values in {k}")
            getattr(module, k).copy_(t)
    module.requires_grad_(False)
    module.digest = file_digest(path)


def file_digest(path: str | Path) -> str:
    """sha256 over the file's content: its metadata (sorted) and every tensor (name, dtype, shape,
    bytes). Not over the raw bytes: safetensors writes metadata in no fixed order."""
    from safetensors import safe_open

    h = hashlib.sha256()
    try:
        with safe_open(str(path), framework="pt") as f:
            h.update(json.dumps(f.metadata() or {}, sort_keys=True).encode())
            for k in sorted(f.keys()):
                t = f.get_tensor(k).contiguous()
                h.update(f"{k}|{t.dtype}|{tuple(t.shape)}".encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    except Exception as e:
        raise AdapterError(f"adapter {Path(path).name}: unreadable ({e})") from e
    return h.hexdigest()


class AdaptedRows:
    """``(layer, k, v) -> (k, v)`` with rows ``[start:]`` corrected by an adapter (the exact head's rows
    before ``start`` kept as read)."""

    def __init__(self, adapter: KVAdapter, start: int):
        self.adapter, self.start = adapter, int(start)

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if k.shape[0] <= self.start:
            return k, v
        # inference mode is per thread: a pipelined source's loader thread is not in the blender's
        with torch.inference_mode():
            # every row corrected at once, the exact head's rows then put back: two small copies, not
            # a concatenation of the whole layer
            ck, cv = self.adapter.correct(layer, k, v)
            ck[: self.start], cv[: self.start] = k[: self.start], v[: self.start]
        return ck, cv


class AdaptedSource:
    """A per-layer KV source (``layer(l) -> (k, v)``) without a ``transform`` hook, read through
    :class:`AdaptedRows`."""

    def __init__(self, source, rows: AdaptedRows):
        self.source, self.rows = source, rows

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows(layer, *self.source.layer(layer))

    def __getattr__(self, name):  # pieces, wait_s, close, ... of the wrapped source
        return getattr(self.source, name)
