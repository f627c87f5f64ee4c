"""Selective prefill: the blend on the one layer loop, behind every prefill mode and the vLLM hook.

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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ragkv.attention.dense import attention_probs
from ragkv.model.forward import run_layers

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


class BlendKV:
    """The K/V of a blend, one layer at a time (a ``LayerKV`` of :func:`ragkv.model.forward.run_layers`).

    Rows ``0 .. n-1`` of a prompt sit at positions ``0 .. n-1``. Per layer, every row's K/V is
    assembled from three places: ``stored`` (pre-RoPE K/V of ``stored_rows``, rotated here to their
    positions; REUSED rows are HKVD candidates), ``posted(layer)`` (post-RoPE K/V of rows
    ``[0, n_posted)``, used as is: an engine's paged cache) and the rows the layer loop computes.
    :meth:`select` is the loop's row selector (HKVD at the schedule's check layers); the assembled
    layer goes to ``out_k/out_v[layer]`` when given (else a per-layer buffer) and to ``on_layer``.
    """

    def __init__(
        self,
        model,
        row_class: torch.Tensor,
        schedule: BlendSchedule | None,
        stored=None,
        stored_rows: torch.Tensor | None = None,
        posted: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
        n_posted: int = 0,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
        keep_pre_rope: int = 0,
        probe_rows: torch.Tensor | None = None,
    ):
        dev, cfg = model.device, model.config
        self.model, self.dev, self.n = model, dev, int(row_class.numel())
        self.pos = torch.arange(self.n, device=dev)
        self.stored = stored
        self.stored_rows = (
            stored_rows.to(dev) if stored_rows is not None else torch.zeros(0, dtype=torch.long, device=dev)
        )
        self.stored_tables = model.rope_tables(self.stored_rows)
        self.posted, self.n_posted = posted, n_posted
        self.reused_mask = row_class.to(dev) == REUSED
        self.n_reused = int(self.reused_mask.sum())
        self.stored_index = torch.full((self.n,), -1, dtype=torch.long, device=dev)
        self.stored_index[self.stored_rows] = torch.arange(self.stored_rows.numel(), device=dev)
        blending = schedule is not None and self.n_reused > 0
        self.schedule = schedule if blending else None
        self.checks = dict(zip(schedule.check_layers, schedule.ratios, strict=True)) if blending else {}
        self.out, self.on_layer = out, on_layer
        shape = (cfg.num_layers, min(int(keep_pre_rope), self.n), cfg.num_kv_heads, cfg.head_dim)
        self.k_pre = torch.empty(shape, dtype=model.dtype, device=dev) if shape[1] else None
        self.probe_rows = probe_rows.to(dev) if probe_rows is not None else None
        self.probes: list[torch.Tensor] | None = [] if probe_rows is not None else None
        self.recomputed: list[int] = []
        self.t_select = 0.0
        self._layer = -1
        self._stored_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fresh: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._kv: tuple[torch.Tensor, torch.Tensor, bool] | None = None

    def first_rows(self, row_class: torch.Tensor) -> torch.Tensor:
        """Rows the loop starts with: every non-EXACT row when blending, else the COMPUTED rows."""
        rc = row_class.to(self.dev)
        return ((rc != EXACT) if self.schedule is not None else (rc == COMPUTED)).nonzero().flatten()

    def stored_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Pre-RoPE K/V of the stored rows on ``layer`` (read once per layer; extra source rows dropped)."""
        if self._layer != layer:
            self._layer, self._stored_kv, self._fresh = layer, None, None
            m = int(self.stored_rows.numel())
            if m:
                k, v = self.stored.layer(layer)
                self._stored_kv = (k[:m], v[:m])
        return self._stored_kv

    # ---- hooks of run_layers -----------------------------------------------------------------------
    def select(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """HKVD at a check layer: the kept local indices of ``rows`` (all non-reused + top deviation)."""
        stored = self.stored_layer(layer)
        if layer not in self.checks:
            return None
        if self.schedule.fresh_check_kv:  # keep every candidate's fresh K/V on this layer
            self._fresh = (rows, self.model.rope(k, rows), v)
        ts = time.perf_counter()
        keep = select_hkvd(
            rows,
            k,
            v,
            stored[0],
            stored[1],
            self.reused_mask,
            self.stored_index,
            self.checks[layer],
            self.n_reused,
            self.schedule.deviation,
        )
        self.t_select += time.perf_counter() - ts
        return keep

    def on_pre_rope(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Counts the rows computed on ``layer``; keeps the pre-RoPE K of rows ``< keep_pre_rope``."""
        self.recomputed.append(int(rows.numel()))
        if self.k_pre is None:
            return
        m = self.k_pre.shape[1]
        stored = self.stored_layer(layer)
        head = self.stored_rows[self.stored_rows < m]
        if stored is not None and head.numel():
            self.k_pre[layer, head] = stored[0][: head.numel()]
        j = int(torch.searchsorted(rows, m))
        self.k_pre[layer, rows[:j]] = k[:j]

    # ---- LayerKV ---------------------------------------------------------------------------------
    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Assembles the layer's K/V of every row: stored (re-rotated), posted, fresh check rows, computed."""
        full = rows.numel() == self.n
        if self.out is not None:
            K, V = self.out[0][layer], self.out[1][layer]
        elif full:
            K, V = k, v
        else:
            K, V = k.new_empty(self.n, *k.shape[1:]), v.new_empty(self.n, *v.shape[1:])
        if full:
            if K is not k:
                K.copy_(k)
                V.copy_(v)
        else:
            stored = self.stored_layer(layer)
            if stored is not None:
                K[self.stored_rows] = self.model.rope(stored[0], self.stored_rows, self.stored_tables)
                V[self.stored_rows] = stored[1]
            if self.n_posted:
                Kp, Vp = self.posted(layer)
                K[: self.n_posted], V[: self.n_posted] = Kp, Vp
            if self._fresh is not None:
                K[self._fresh[0]], V[self._fresh[0]] = self._fresh[1], self._fresh[2]
            K[rows], V[rows] = k, v
        self._kv = (K, V, full)
        if self.on_layer is not None:
            self.on_layer(layer, K, V)

    def attend(self, layer: int, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Attention of the computed rows over every row of the layer (position blocks when scattered)."""
        K, V, full = self._kv
        if self.probes is not None:
            local = torch.searchsorted(rows, self.probe_rows)
            self.probes.append(
                attention_probs(
                    q[local],
                    K,
                    self.probe_rows,
                    self.pos,
                    self.model.scale,
                    self.model.config.window(layer),
                )
            )
        return self.model.attend(
            layer,
            q,
            K,
            V,
            rows,
            self.pos,
            contiguous=full,
            position_blocks=0 if full else POSITION_BLOCKS,
        )

    def stats(self) -> dict:
        """Rows recomputed per layer and time spent selecting / waiting for stored KV."""
        return {
            "recomputed_per_layer": self.recomputed,
            "t_select_s": self.t_select,
            "t_load_wait_s": getattr(self.stored, "wait_s", 0.0) if self.stored is not None else 0.0,
        }


@torch.inference_mode()
def blend_layers(
    model, token_ids: torch.Tensor, row_class: torch.Tensor, kv: BlendKV, last_layer_attention: bool = True
) -> torch.Tensor:
    """The blend's layer loop: the rows :meth:`BlendKV.first_rows` picks, through :func:`run_layers`.

    Returns the hidden states of the rows still computed after the last layer (sorted by row);
    closes the stored source.
    """
    rows = kv.first_rows(row_class)
    try:
        h, _ = run_layers(
            model,
            model.embed(token_ids.to(kv.dev)[rows]),
            rows,
            kv,
            select=kv.select,
            on_pre_rope=kv.on_pre_rope,
            last_layer_attention=last_layer_attention,
        )
    finally:
        if kv.stored is not None:
            kv.stored.close()
    return h


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
    """Prefill a prompt whose cached rows come from ``source`` (every prefill mode; see the module doc).

    ``source.layer(l)`` gives pre-RoPE K/V of the EXACT/REUSED rows in order. ``keep_pre_rope=m``
    also returns the pre-RoPE K of the first ``m`` rows (``kv.k_pre [L, m, ...]``) for prefix-cache
    inserts; only exactly computed rows may be inserted, which the caller ensures.
    """
    t_start = time.perf_counter()
    dev, cfg = model.device, model.config
    n = int(token_ids.numel())
    if n == 0:
        raise ValueError("empty prompt")
    model.check_length(n)
    row_class = row_class.to(dev).clone()
    # the last token's hidden state must be exact for the first logits: always computed. If it was
    # cached, its row is the source's last row, which BlendKV then drops.
    row_class[-1] = COMPUTED
    cached = (row_class != COMPUTED).nonzero().flatten()
    if cached.numel() and source is None:
        raise ValueError("rows marked cached but no KV source given")
    if probe_rows is not None and bool((row_class[probe_rows] != COMPUTED).any()):
        raise ValueError("probe rows must be computed (suffix) rows")
    out_k = torch.empty(cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=dev)
    out_v = torch.empty_like(out_k)
    kv = BlendKV(
        model,
        row_class,
        schedule,
        stored=source,
        stored_rows=cached,
        out=(out_k, out_v),
        keep_pre_rope=keep_pre_rope,
        probe_rows=probe_rows,
    )
    h = blend_layers(model, token_ids, row_class, kv)
    logits = model.logits(h[-1:])[0].float()
    recomputed = kv.recomputed
    stats = {
        "num_tokens": n,
        "num_computed_rows": int((row_class == COMPUTED).sum()),
        "num_exact_rows": int((row_class == EXACT).sum()),
        "num_reused_rows": kv.n_reused,
        "recompute_fraction": sum(recomputed) / (cfg.num_layers * n),
        **kv.stats(),
        "t_prefill_s": time.perf_counter() - t_start,
    }
    pos = torch.arange(n, device=dev)
    return PrefillResult(logits, PromptKV(out_k, out_v, pos, token_ids.to(dev), kv.k_pre), stats, kv.probes)


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
