"""Prefill's linear layers on float32 weights prepacked once for oneDNN (the layout its GEMM kernels read).

Why: a prompt's pass multiplies every weight by its rows; PyTorch's ``F.linear`` re-reads the plain
row-major weight each call, where oneDNN's packed layout feeds its kernels directly. Measured on the
project machine (AVX-512, one thread, SmolLM2-135M): a follow-up chat turn's pass (20 rows after 3,700
cached tokens) 272-301 -> 237-240 ms CPU, a cold 3,688-token prefill 18.0-18.7 -> 16.6-17.0 s CPU.

Exactness: a row's output must not depend on how many rows share the call (the exact KV tree's
split invariance, ``ragkv.attention.exact``). The packed kernels hold that for every row count from 2 up
(measured: AVX-512 and AVX2, 1 and 2 threads, every count 2-129 and up to 3,200, and at row offsets);
one row alone may differ, and exact passes have at least 16 rows. The per-process self-check
(``ragkv.blend.exact.exactness_check``) verifies it on the machine at hand. The packed results are not
``F.linear``'s bits (another summation order, ~1e-5 on the logits): the KV tree's root names the GEMM
(:data:`Model.gemm`), so pages of one never match the other.

Costs: the packed copies sit beside the plain weights (float32 decode, export and the low-bit decode's
fallback read those): +425 MB for the default model. ``RAGKV_PACKED_GEMM=0`` turns packing off.
``_reorder_linear_weight`` / ``_linear_pointwise`` are the ops torch's own inductor CPU backend packs
linear layers with; where this torch build lacks them, the plain ``F.linear`` runs.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

#: the rows a packed weight is laid out for (a hint to oneDNN; any row count works)
ROWS_HINT = 32


def _ops():
    mk = getattr(torch.ops, "mkldnn", None)
    reorder = getattr(mk, "_reorder_linear_weight", None) if mk is not None else None
    pointwise = getattr(mk, "_linear_pointwise", None) if mk is not None else None
    return reorder, pointwise


def packing_enabled() -> bool:
    """Whether float32 CPU weights are packed (the ops exist, oneDNN is built in, not turned off)."""
    if os.environ.get("RAGKV_PACKED_GEMM", "1") in ("0", "false", "no"):
        return False
    reorder, pointwise = _ops()
    return reorder is not None and pointwise is not None and torch.backends.mkldnn.is_available()


class PackedWeight:
    """The packed copy of one weight, made again when the weight was changed in place (its version
    counter) or replaced (another tensor): a stale copy would compute with the old values."""

    __slots__ = ("source", "version", "packed")

    def __init__(self, w: torch.Tensor):
        self.source, self.version, self.packed = w, _version(w), pack(w)

    def get(self, w: torch.Tensor) -> torch.Tensor | None:
        if w is not self.source or _version(w) != self.version:
            self.source, self.version, self.packed = w, _version(w), pack(w)
        return self.packed


def _version(w: torch.Tensor) -> int | None:
    """``w``'s in-place version counter (None for an inference-mode tensor, which keeps none)."""
    try:
        return w._version
    except RuntimeError:
        return None


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """``w [out, in]`` packed for oneDNN, or None where it is not packed (not float32 on the CPU, packing
    off or unavailable)."""
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2 or not packing_enabled():
        return None
    reorder, _ = _ops()
    try:
        return reorder(w.contiguous(), ROWS_HINT)
    except RuntimeError:  # an op this build cannot run: the plain path stays
        return None


def linear(x: torch.Tensor, w: torch.Tensor, slot: PackedWeight | None, b: torch.Tensor | None = None):
    """``F.linear(x, w, b)`` of rows ``x [n, in]``, on ``w``'s packed copy in ``slot`` when there is one
    (no autograd through it: an input or weight that needs gradients takes the plain path)."""
    if (
        slot is None
        or x.dim() != 2
        or x.shape[0] == 0
        or x.requires_grad
        or w.requires_grad
        or x.dtype != torch.float32
    ):
        return F.linear(x, w, b)
    # a compiled graph takes the packed copy as it is (the version check is Python state it cannot trace)
    packed = slot.packed if torch.compiler.is_compiling() else slot.get(w)
    if packed is None:
        return F.linear(x, w, b)
    _, pointwise = _ops()
    return pointwise(x.contiguous(), packed, b, "none", [], "")
