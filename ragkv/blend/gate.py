"""Per-model correctness gate for blending: run once per model, before its first reuse or blend.

Reference implementations silently produced garbage on some models (wrong re-RoPE for some
architectures, no RoPE-scaling support, selected rows mapped to wrong positions when a cached
prefix is combined with blended chunks). So before any stored chunk KV is reused we check, on a
probe prompt: (1) RoPE re-positioning of a chunk equals recomputing it at the new offset, and
scores depend only on relative position; (2) ``blend`` at ratio 1.0 equals ``full``; (3) the same
with a cached prefix. Rotations in the checks run in float32 and the tolerance comes from the
model's dtype (:func:`tolerance`): in bfloat16 a chunk recomputed at another offset differs from the
re-positioned one by rounding accumulated over the layers, while a position bug errs by order 1. On failure blending is disabled for the model (``model.blend_ok = False``)
and reuse/blend requests fall back to full prefill with a warning. :func:`ensure_gate` runs it lazily
from :func:`ragkv.blend.prefill` (so every path that blends is gated: ``ragkv.LLM``, ``ragkv.prefill``
on a bare model, the engine, the service) and keeps the report per model (:func:`gate_report`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field

import torch

from ragkv.blend.assemble import assemble as prefill
from ragkv.blend.core import BlendSchedule
from ragkv.blend.kvtree import KVTree
from ragkv.model.forward import compute_chunk_kv, exact_supported

log = logging.getLogger("ragkv.blend")


@dataclass
class GateReport:
    ok: bool
    checks: dict[str, float] = field(default_factory=dict)  # name -> relative error
    failed: list[str] = field(default_factory=list)
    tolerance: float = 0.0


def tolerance(dtype: torch.dtype) -> float:
    """Relative error the probe checks allow in ``dtype``: ``max(1e-4, 8 * eps)`` (see docs/DEVIATIONS.md)."""
    return max(1e-4, 8 * torch.finfo(dtype).eps)


def _rope32(model, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x`` rotated at ``positions`` in float32 (the re-RoPE precision of the check, not of bf16 storage)."""
    positions = positions.to(model.device)
    return model.rotary.apply(x.float(), positions, model.rotary.cos_sin(positions, torch.float32))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


@torch.inference_mode()
def self_check(model, seed: int = 0, chunk_len: int = 12, set_flag: bool = True) -> GateReport:
    """Run the probe checks; sets ``model.blend_ok`` unless ``set_flag`` is False."""
    cfg = model.config
    tol = tolerance(model.dtype)
    g = torch.Generator().manual_seed(seed)
    lo = 3 if cfg.vocab_size > 3 else 0

    def rand(n: int) -> list[int]:
        return torch.randint(lo, cfg.vocab_size, (n,), generator=g).tolist()

    bos = [cfg.bos_token_id] if cfg.bos_token_id is not None else []
    prefix, chunks, suffix = bos + rand(4), [rand(chunk_len), rand(chunk_len)], rand(4)
    if len(prefix) + 2 * chunk_len + len(suffix) > cfg.max_position:
        raise ValueError("model context too short for the self-check probe")
    checks: dict[str, float] = {}

    # (1) re-positioning: stored chunk, rotated to offset m == the chunk recomputed at offset m
    kv = compute_chunk_kv(model, chunks[0])
    m = len(prefix) + 3
    start = kv.start_pos
    ids = torch.tensor(bos + chunks[0])
    positions = torch.arange(m - start, m - start + ids.numel())
    _, k_at_m, _ = model.forward(ids.to(model.device), positions.to(model.device), capture_kv=True)
    new_pos = torch.arange(m, m + chunk_len, device=model.device)
    worst = 0.0
    for layer in range(cfg.num_layers):
        a = _rope32(model, kv.k[layer], new_pos)
        b = _rope32(model, k_at_m[layer, start:], new_pos)
        worst = max(worst, _rel(a, b))
    checks["rope_reposition"] = worst
    # relative-position property: q(m+d).k(n+d) == q(m).k(n)
    qv = torch.randn(1, cfg.num_heads, cfg.head_dim, generator=g).to(model.device, model.dtype)
    kvec = torch.randn(1, cfg.num_heads, cfg.head_dim, generator=g).to(model.device, model.dtype)

    def score(pq: int, pk: int) -> torch.Tensor:
        t = lambda p: torch.tensor([p], device=model.device)  # noqa: E731
        return (_rope32(model, qv, t(pq)) * _rope32(model, kvec, t(pk))).sum(-1)

    checks["rope_relative"] = _rel(score(m + 37, m), score(7 + 37, 7))

    # (2) blend at ratio 1.0 == full, and (3) with a cached prefix
    kvs = [kv, compute_chunk_kv(model, chunks[1])]
    full = prefill(model, prefix, kvs, suffix, "full")
    one = BlendSchedule.single(1.0)
    # run the real paths (True: no fallback to full, no gate inside the gate) even if a previous gate failed
    saved, model.blend_ok = model.blend_ok, True
    try:
        b = prefill(model, prefix, kvs, suffix, "blend", schedule=one)
        checks["blend1_logits"] = _rel(b.logits, full.logits)
        checks["blend1_kv"] = max(_rel(b.kv.k, full.kv.k), _rel(b.kv.v, full.kv.v))
        if exact_supported(model):  # the exact head from the KV tree (none for sliding-window models)
            pc = KVTree()
            prefill(model, prefix, [], [], "prefix", prefix_cache=pc)
            bp = prefill(model, prefix, kvs, suffix, "blend", schedule=one, prefix_cache=pc)
            if bp.stats["num_exact_rows"] != len(prefix):
                checks["prefix_plus_blend"] = float("inf")
            else:
                checks["prefix_plus_blend"] = _rel(bp.logits, full.logits)
    finally:
        model.blend_ok = saved
    # blend@1 recomputes every row through the same kernels as full: equal bit for bit in any dtype
    limits = {"rope_relative": tol * 10, "blend1_logits": 0.0, "blend1_kv": 0.0}
    failed = [name for name, err in checks.items() if not err <= limits.get(name, tol)]
    report = GateReport(ok=not failed, checks=checks, failed=failed, tolerance=tol)
    if set_flag:
        model.blend_ok = report.ok
        _REPORTS[model] = report
    if failed:
        log.warning(
            "blending disabled for %s: self-check failed %s (errors %s); requests fall back to full prefill",
            model.name,
            failed,
            {k: checks[k] for k in failed},
        )
    else:
        log.info("blending self-check passed for %s: %s", model.name, checks)
    return report


_REPORTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GATE_LOCK = threading.Lock()


def ensure_gate(model) -> bool:
    """Run the gate on ``model`` unless it ran (cached per model); whether blending is allowed."""
    if model.blend_ok is not None:
        return bool(model.blend_ok)
    with _GATE_LOCK:  # one run, even when the first blends of a model arrive together
        if model.blend_ok is None:
            self_check(model)
    return bool(model.blend_ok)


def gate_report(model) -> GateReport | None:
    """The gate's report for ``model`` (None: it has not run yet)."""
    return _REPORTS.get(model)


def gate_state(model) -> str:
    """``"passed"``, ``"failed"`` (reuse and blend fall back to full) or ``"pending"`` (not run yet)."""
    return "pending" if model.blend_ok is None else "passed" if model.blend_ok else "failed"
