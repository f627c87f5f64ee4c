"""Learned link rows (issue 38's candidate L): a few trained input embeddings after each reused chunk,
computed in context at query time like the rows a blend recomputes.

Each chunk's stored KV stays the plain chunk convention; at query time ``n`` link rows follow every
chunk. They run through every layer of the unchanged model, attending to the prompt before them (the
head, the reused chunks, the earlier links), and the question attends to them: what a chunk written on
its own cannot know about its neighbours can reach the question through them. Only their ``n x hidden``
input embeddings are trained (by KL to full prefill of the prompt *without* links,
:mod:`ragkv.adapter.train` kind ``"link"``); the gradient goes through the reader rows alone.

The rows are ordinary prompt rows with virtual token ids (``vocab_size + j``) that only
:class:`LinkedModel` embeds, so the blend, the KV cache and decoding need nothing new. They take
positions, so the text after the first chunk sits ``n`` positions later per chunk than in the
prompt's full prefill (the training absorbs the shift).

Deviations from KVLink (docs/DEVIATIONS.md): KVLink fine-tunes the whole model with its link tokens;
here the model is frozen and only the link embeddings learn, so full prefill stays the user's model.
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

FORMAT = "ragkv-link-rows/1"


@dataclass(frozen=True)
class LinkSpec:
    """How many link rows follow each chunk, their width, and the model they were trained for."""

    num_links: int
    hidden: int
    vocab_size: int
    model_fingerprint: str


class LinkRows(nn.Module):
    """``num_links`` trained input embeddings, started at the mean token embedding (small noise apart)."""

    def __init__(self, spec: LinkSpec, init: torch.Tensor | None = None, seed: int = 0):
        super().__init__()
        if spec.num_links < 1:
            raise ValueError("link rows need num_links >= 1")
        self.spec = spec
        g = torch.Generator().manual_seed(seed)
        base = torch.zeros(spec.hidden) if init is None else init.detach().float().cpu()
        noise = torch.randn(spec.num_links, spec.hidden, generator=g) * 0.02 * (base.std() + 1e-3)
        self.emb = nn.Parameter(base.expand(spec.num_links, -1).clone() + noise)

    @classmethod
    def for_model(cls, model, num_links: int = 8, seed: int = 0) -> LinkRows:
        c = model.config
        spec = LinkSpec(num_links, model.embed_w.shape[1], c.vocab_size, model.fingerprint)
        return cls(spec, model.embed_w.float().mean(0), seed)

    @property
    def ids(self) -> list[int]:
        """The link rows' virtual token ids (after the model's vocabulary)."""
        return [self.spec.vocab_size + j for j in range(self.spec.num_links)]

    def interleave(self, chunks: list) -> list:
        """``chunks`` with the link rows' ids after each: the prompt's chunk list for prefill."""
        out: list = []
        for c in chunks:
            out += [c, list(self.ids)]
        return out

    # ---- files ----------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        return {"emb": self.emb.detach().float().contiguous().cpu()}

    def save(self, path: str | Path, meta: dict | None = None) -> str:
        """Write the link rows (safetensors, spec in the metadata); returns the file's digest."""
        return write_adapter_file(path, FORMAT, self.spec.__dict__, self.state(), meta)

    @classmethod
    def load(cls, path: str | Path, model=None, digest: str | None = None) -> LinkRows:
        """Read link rows; refuses a changed digest, a foreign format, or another model's file."""

        def fits(spec: LinkSpec, model) -> bool:
            return (spec.hidden, spec.vocab_size) == (model.embed_w.shape[1], model.config.vocab_size)

        return load_adapter_module(cls, Path(path), FORMAT, LinkSpec, digest, model, fits)

    @property
    def identity(self) -> str:
        return adapter_identity(self)


class LinkedModel:
    """The user's model whose embedding also knows the link rows' virtual ids; everything else (layers,
    head, config, fingerprint) is the model's own."""

    def __init__(self, model, links: LinkRows):
        self.base, self.links = model, links
        self._vocab = links.spec.vocab_size

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        ids = token_ids.to(self.base.device)
        link = ids >= self._vocab
        if not bool(link.any()):
            return self.base.embed(ids)
        h = self.base.embed(ids.clamp(max=self._vocab - 1))
        e = self.links.emb.to(h.device, h.dtype)[(ids - self._vocab).clamp(0, self.links.spec.num_links - 1)]
        return torch.where(link.unsqueeze(-1), e, h)

    @property
    def blend_ok(self) -> bool | None:
        """The blending gate's state is the model's (the link rows change no layer): read and set there,
        so the gate runs once per model, not once per wrapper."""
        return self.base.blend_ok

    @blend_ok.setter
    def blend_ok(self, value: bool | None) -> None:
        self.base.blend_ok = value

    def __getattr__(self, name):
        return getattr(self.base, name)
