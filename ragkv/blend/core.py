"""Selective prefill: the one layer loop behind every prefill mode.

Each prompt row is of one class:

* ``COMPUTED``: no stored KV (the query suffix, uncached text); recomputed on every layer.
* ``EXACT``: stored KV that equals what a full prefill computes (a cached prefix); never recomputed.
* ``REUSED``: a chunk's KV computed alone and re-positioned by RoPE; approximate, so it is a
  candidate for HKVD recompute (CacheBlend) or used as is (full KV reuse).

With a blend schedule, REUSED rows are computed on every layer before the first check layer; at
each check layer the fresh Q/K/V of the candidates are computed, the top ``ratio * n_reused`` by
KV deviation are kept, and only kept rows (plus COMPUTED ones) go on. Deviation from the paper:
the selection happens between the QKV projection and attention of the check layer, and rows that
are not kept use their *reused* KV on that layer. So ``ratio=0`` is exactly full KV reuse and
``ratio=1`` exactly a full prefill, and the check layer's attention/MLP already run on the
selected rows only. See docs/DEVIATIONS.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ragkv.attention.dense import attention_probs

COMPUTED, EXACT, REUSED = 0, 1, 2
POSITION_BLOCKS = (
    4  # measured: 4 beats 1 and 8 for 16% scattered rows of 3K tokens (fewer, larger SDPA calls)
)


@dataclass(frozen=True)
class BlendSchedule:
    """Gradual filtering: check layers with non-increasing recompute ratios (of the reused rows)."""

    check_layers: tuple[int, ...] = (1,)
    ratios: tuple[float, ...] = (0.15,)
    #: "k", "v" or "kv": which fresh-vs-stored difference ranks tokens. K by default: on the real
    #: model (SmolLM2-135M, 30 layers) blend@0.15's first-token KL is 0.24x reuse's with K vs 0.38x
    #: with V (eval.bench_blend_schedule, MuSiQue; docs/DEVIATIONS.md); V won narrowly on the 5-layer
    #: tiny model only.
    deviation: str = "k"
    #: keep the *fresh* K/V of every candidate on check layers (the paper computes check layers fully)
    #: instead of the reused K/V of the rows not kept; False makes ratio 0 exactly full KV reuse
    fresh_check_kv: bool = False

    def __post_init__(self):
        if len(self.check_layers) != len(self.ratios) or not self.check_layers:
            raise ValueError("check_layers and ratios must be non-empty and of equal length")
        if list(self.check_layers) != sorted(set(self.check_layers)):
            raise ValueError("check_layers must be strictly increasing")
        if any(not 0.0 <= r <= 1.0 for r in self.ratios):
            raise ValueError("recompute ratios must be in [0, 1]")
        if any(b > a for a, b in zip(self.ratios, self.ratios[1:], strict=False)):
            raise ValueError("recompute ratios must be non-increasing (nested selections)")
        if self.deviation not in ("k", "v", "kv"):
            raise ValueError("deviation must be 'k', 'v' or 'kv'")

    @classmethod
    def single(
        cls, ratio: float, check_layer: int = 1, deviation: str = "k", fresh_check_kv: bool = False
    ) -> BlendSchedule:
        return cls((check_layer,), (ratio,), deviation, fresh_check_kv)

    @property
    def target_ratio(self) -> float:
        return self.ratios[-1]


@dataclass
class PromptKV:
    """The prompt's KV after prefill: post-RoPE K and V ``[L, N, Hkv, D]`` at ``positions [N]``."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    token_ids: torch.Tensor
    k_pre: torch.Tensor | None = None  # pre-RoPE K, kept only when asked (prefix-cache inserts)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [vocab] fp32, of the last prompt token
    kv: PromptKV
    stats: dict = field(default_factory=dict)
    attn_probs: list[torch.Tensor] | None = None  # per layer [P, Hq, N] for probe rows


@torch.inference_mode()
def selective_prefill(
    model,
    token_ids: torch.Tensor,
    row_class: torch.Tensor,
    source=None,
    schedule: BlendSchedule | None = None,
    probe_rows: torch.Tensor | None = None,
    keep_pre_rope: int = 0,
) -> PrefillResult:
    """Run the layer loop. ``source.layer(l)`` gives pre-RoPE K/V of the EXACT/REUSED rows in order.

    ``keep_pre_rope=m`` also returns the pre-RoPE K of the first ``m`` rows (``kv.k_pre [L, m, ...]``)
    for prefix-cache inserts; only exactly computed rows may be inserted, which the caller ensures.
    """
    t_start = time.perf_counter()
    dev = model.device
    cfg = model.config
    n = int(token_ids.numel())
    if n == 0:
        raise ValueError("empty prompt")
    model.check_length(n)
    row_class = row_class.to(dev).clone()
    # the last token's hidden state must be exact for the first logits: always computed. If it was
    # cached, its row is the source's last row, which the layer loop then drops.
    drop_last_cached = bool(row_class[-1] != COMPUTED)
    row_class[-1] = COMPUTED
    pos = torch.arange(n, device=dev)
    cached = (row_class != COMPUTED).nonzero().flatten()
    reused_mask = row_class == REUSED
    n_reused = int(reused_mask.sum())
    cache_index = torch.full((n,), -1, dtype=torch.long, device=dev)
    cache_index[cached] = torch.arange(cached.numel(), device=dev)
    if cached.numel() and source is None:
        raise ValueError("rows marked cached but no KV source given")

    blending = schedule is not None and n_reused > 0
    active = (row_class != EXACT) if blending else (row_class == COMPUTED)
    S = active.nonzero().flatten()
    checks = dict(zip(schedule.check_layers, schedule.ratios, strict=True)) if blending else {}

    cs_all = model.rotary.cos_sin(pos, model.dtype)
    L = cfg.num_layers
    out_k = torch.empty(L, n, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=dev)
    out_v = torch.empty_like(out_k)
    n_kpre = min(int(keep_pre_rope), n)
    out_kpre = out_k.new_empty(L, n_kpre, cfg.num_kv_heads, cfg.head_dim) if n_kpre else None
    cached_head = cached[cached < n_kpre]
    probes: list[torch.Tensor] | None = [] if probe_rows is not None else None
    if probe_rows is not None and bool((row_class[probe_rows] != COMPUTED).any()):
        raise ValueError("probe rows must be computed (suffix) rows")

    h = model.embed(token_ids.to(dev)[S])
    try:
        recomputed: list[int] = []
        t_select = 0.0
        cs_cached = (cs_all[0][cached], cs_all[1][cached])
        pos_cached = pos[cached]
        cs, cs_rows = None, None
        for layer in range(cfg.num_layers):
            Kc = Vc = None
            if cached.numel() or drop_last_cached:
                Kc, Vc = source.layer(layer)
                if drop_last_cached:
                    Kc, Vc = Kc[:-1], Vc[:-1]
            q, k, v = model.qkv(layer, h)
            fresh = None
            if layer in checks:
                if schedule.fresh_check_kv:
                    fresh = (S, model.rotary.apply(k, pos[S], (cs_all[0][S], cs_all[1][S])), v)
                ts = time.perf_counter()
                keep = select_hkvd(
                    S, k, v, Kc, Vc, reused_mask, cache_index, checks[layer], n_reused, schedule.deviation
                )
                S, h, q, k, v = S[keep], h[keep], q[keep], k[keep], v[keep]
                t_select += time.perf_counter() - ts
            recomputed.append(int(S.numel()))
            if cs_rows is not S:  # S only changes at check layers
                cs, cs_rows = (cs_all[0][S], cs_all[1][S]), S
            q = model.rotary.apply(q, pos[S], cs)
            if out_kpre is not None:
                if Kc is not None and cached_head.numel():
                    out_kpre[layer, cached_head] = Kc[: cached_head.numel()]
                j = int(torch.searchsorted(S, n_kpre))
                out_kpre[layer, S[:j]] = k[:j]
            k = model.rotary.apply(k, pos[S], cs)
            full_rows = S.numel() == n
            if full_rows:
                out_k[layer], out_v[layer] = k, v
            else:
                out_k[layer, cached] = model.rotary.apply(Kc, pos_cached, cs_cached)
                out_v[layer, cached] = Vc
                if fresh is not None:
                    out_k[layer, fresh[0]], out_v[layer, fresh[0]] = fresh[1], fresh[2]
                out_k[layer, S], out_v[layer, S] = k, v
            # sorted query rows over keys at positions 0..n-1: attend in position blocks (see attention())
            o = model.attend(
                layer,
                q,
                out_k[layer],
                out_v[layer],
                pos[S],
                pos,
                contiguous=full_rows,
                position_blocks=0 if full_rows else POSITION_BLOCKS,
            )
            if probes is not None:
                local = torch.searchsorted(S, probe_rows.to(pos.device))
                probes.append(
                    attention_probs(
                        q[local], out_k[layer], pos[probe_rows], pos, model.scale, cfg.window(layer)
                    )
                )
            h = model.finish_layer(layer, h, o)
    finally:
        if source is not None:
            source.close()
    logits = model.logits(h[-1:])[0].float()

    stats = {
        "num_tokens": n,
        "num_computed_rows": int((row_class == COMPUTED).sum()),
        "num_exact_rows": int((row_class == EXACT).sum()),
        "num_reused_rows": n_reused,
        "recomputed_per_layer": recomputed,
        "recompute_fraction": sum(recomputed) / (L * n),
        "t_select_s": t_select,
        "t_load_wait_s": getattr(source, "wait_s", 0.0) if source is not None else 0.0,
        "t_prefill_s": time.perf_counter() - t_start,
    }
    kv = PromptKV(out_k, out_v, pos, token_ids.to(dev), out_kpre)
    return PrefillResult(logits, kv, stats, probes)


def select_hkvd(S, k, v, Kc, Vc, reused_mask, cache_index, ratio, n_reused, deviation) -> torch.Tensor:
    """Local indices into S of the rows to keep: all non-reused rows + top-deviation reused rows."""
    is_r = reused_mask[S]
    cand = is_r.nonzero().flatten()
    keep_n = min(int(cand.numel()), int(round(ratio * n_reused)))
    if keep_n > 0:
        ci = cache_index[S[cand]]
        score = torch.zeros(cand.numel(), dtype=torch.float32, device=S.device)
        if deviation in ("v", "kv"):
            score += (v[cand].float() - Vc[ci].float()).pow(2).sum(dim=(1, 2))
        if deviation in ("k", "kv"):
            # pre-RoPE vs pre-RoPE: rotations preserve norms, so this equals the post-RoPE deviation
            score += (k[cand].float() - Kc[ci].float()).pow(2).sum(dim=(1, 2))
        top = cand[score.topk(keep_n).indices]
    else:
        top = cand[:0]
    keep = torch.cat([(~is_r).nonzero().flatten(), top])
    return keep.sort().values
