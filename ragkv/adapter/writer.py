"""A chunk-KV writer (W-full, SemPIC's form): a LoRA on the attention projections, on only while chunk
KV is written.

The writer is the user's model with a low-rank update of its fused q/k/v projection and of its o
projection, used for the chunk's own prefill at ingest and never where a prompt's rows are computed
(the question, recomputed rows, decoded tokens). So the decoder stays the user's model, full prefill is
unchanged, and a blend at ratio 1.0 (every row recomputed from layer 0) still equals full prefill.
Trained by KL to full prefill through the whole writer pass (:mod:`ragkv.adapter.train`, ``kind
"writer"``): a step costs ~15x a W-kv step, so it is the GPU candidate of issue 38.

Deviations from SemPIC (docs/DEVIATIONS.md): one A matrix shared by q, k and v (ragkv fuses the three
projections into one matmul; 645K parameters on the default model, not 922K); chunk KV is written after
BOS (the chunk convention), or after a fixed context when trained on context-primed KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ragkv.adapter.kv_adapter import (
    adapter_identity,
    load_adapter_module,
    write_adapter_file,
)
from ragkv.model.forward import packed_chunk_kv_rows
from ragkv.model.llama import rms_norm

FORMAT = "ragkv-writer-adapter/1"


@dataclass(frozen=True)
class WriterSpec:
    """The shape of a writer LoRA and the model it was trained for."""

    num_layers: int
    hidden: int
    q_width: int  # num_heads * head_dim
    kv_width: int  # num_kv_heads * head_dim
    rank: int
    alpha: float
    model_fingerprint: str


class WriterLoRA(nn.Module):
    """Per layer: ``qkv += s * B_qkv A_qkv x`` (x the normalised layer input) and ``o += s * B_o A_o a``
    (a the attention output), ``s = alpha / rank``. The B matrices start at zero: an untrained writer
    writes exactly today's chunk KV."""

    def __init__(self, spec: WriterSpec, seed: int = 0):
        super().__init__()
        if spec.rank < 1:
            raise ValueError("a writer LoRA needs rank >= 1")
        self.spec = spec
        L, d, r = spec.num_layers, spec.hidden, spec.rank
        g = torch.Generator().manual_seed(seed)
        self.a_qkv = nn.Parameter(torch.randn(L, r, d, generator=g) / d**0.5)
        self.b_qkv = nn.Parameter(torch.zeros(L, spec.q_width + 2 * spec.kv_width, r))
        self.a_o = nn.Parameter(torch.randn(L, r, spec.q_width, generator=g) / spec.q_width**0.5)
        self.b_o = nn.Parameter(torch.zeros(L, d, r))

    @property
    def scale(self) -> float:
        return self.spec.alpha / self.spec.rank

    @classmethod
    def for_model(cls, model, rank: int = 8, alpha: float = 16.0, seed: int = 0) -> WriterLoRA:
        c = model.config
        spec = WriterSpec(
            c.num_layers,
            int(model.embed_w.shape[1]),
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            rank,
            float(alpha),
            model.fingerprint,
        )
        return cls(spec, seed)

    #: its effect is in the chunk KV it writes (a chunk store of its own): read as stored
    writes_kv = True

    def model(self, base) -> WriterModel:
        """``base`` with this writer on (a layer model for :func:`ragkv.model.forward.run_layers`)."""
        return WriterModel(base, self)

    @property
    def trainable(self) -> bool:
        """Whether it is being trained (parameters that require grad): its KV then has no name yet."""
        return any(p.requires_grad for p in self.parameters())

    def kv_fingerprint(self, base) -> str:
        """The fingerprint of chunk KV this writer writes for ``base``: keys and checks never mix it
        with the base model's KV."""
        return f"{base.fingerprint}+writer-{self.identity}"

    def wrap_source(self, source, start: int):
        """Reused rows are read as stored (the blend's adapter hook): the writer acted when they were
        written."""
        return source

    def chunk_kvs(self, base, chunks: list, context_ids=()) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each chunk's pre-RoPE ``(k, v) [L, n, Hkv, D]`` as this writer writes it (differentiable), all
        of them in one packed pass (training: one layer loop a prompt)."""
        return packed_chunk_kv_rows(self.model(base), chunks, context_ids)

    # ---- files ----------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        return {
            k: getattr(self, k).detach().float().contiguous().cpu() for k in ("a_qkv", "b_qkv", "a_o", "b_o")
        }

    def save(self, path: str | Path, meta: dict | None = None) -> str:
        """Write the writer (safetensors, its spec in the metadata); returns the file's digest."""
        return write_adapter_file(path, FORMAT, self.spec.__dict__, self.state(), meta)

    @classmethod
    def load(cls, path: str | Path, model=None, digest: str | None = None) -> WriterLoRA:
        """Read a writer; refuses a file whose digest differs from ``digest``, a foreign format, a shape
        that does not fit, or (given ``model``) another model's writer."""
        path = Path(path)

        def fits(spec: WriterSpec, model) -> bool:
            c = model.config
            shape = (
                c.num_layers,
                int(model.embed_w.shape[1]),
                c.num_heads * c.head_dim,
                c.num_kv_heads * c.head_dim,
            )
            return (spec.num_layers, spec.hidden, spec.q_width, spec.kv_width) == shape

        return load_adapter_module(cls, path, FORMAT, WriterSpec, digest, model, fits)

    @property
    def identity(self) -> str:
        """Short id for keys and reports: the digest of its tensors (the file's when loaded)."""
        return adapter_identity(self)


class WriterModel:
    """A layer model: ragkv's :class:`~ragkv.model.llama.Model` with a writer's LoRA added to q/k/v and
    o; everything else (embedding, RoPE, attention, MLP, config) is the base model's. Its fingerprint
    names the writer, so KV it writes never passes for the base model's."""

    def __init__(self, base, writer: WriterLoRA):
        self.base, self.writer = base, writer
        self.fingerprint = writer.kv_fingerprint(base) if not writer.trainable else ""

    @property
    def prompt_model(self):
        """The model a prompt's rows run on (the question, recomputed rows, decoding): the base."""
        return self.base

    def __getattr__(self, name):  # config, device, dtype, scale, embed, rope, attend, check_length ...
        return getattr(self.base, name)

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.base.qkv(layer, h)
        w, lw = self.writer, self.base.layers[layer]
        x = rms_norm(h, lw.in_norm, self.base.config.rms_norm_eps)
        d = (x @ w.a_qkv[layer].to(x.dtype).T) @ (w.b_qkv[layer].to(x.dtype).T * w.scale)
        nq, nk = w.spec.q_width, w.spec.kv_width
        return (
            q + d[:, :nq].view_as(q),
            k + d[:, nq : nq + nk].view_as(k),
            v + d[:, nq + nk :].reshape(v.shape),
        )

    def finish_layer(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        # h + o(a) + s B A a, then the MLP on that sum: the base's finish_layer on (h + delta)
        w = self.writer
        a = attn_out.reshape(h.shape[0], -1)
        delta = (a @ w.a_o[layer].to(a.dtype).T) @ (w.b_o[layer].to(a.dtype).T * w.scale)
        return self.base.finish_layer(layer, h + delta, attn_out)
