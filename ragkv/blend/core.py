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

Beyond CacheBlend (``BlendSchedule`` fields, the same loop): the question's attention as selector
(``qattn``/``mix``), a question-only pass that picks the rows before layer 0 (``qpass``, the default),
per-chunk probe offsets added to the rows that are not recomputed (``offset``, on by default),
seam rows, and APE's temperature/scale on the question's attention to the reused rows (off). Every option keeps ``ratio=1 == full`` and ``ratio=0 == reuse``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ragkv.attention.dense import ContextTemper, attention_probs, explicit_attention
from ragkv.defaults import DEFAULT_RATIO
from ragkv.model.forward import run_layers
from ragkv.model.result import PrefillResult, PromptKV  # noqa: F401 - the prefill's result, re-exported

COMPUTED, EXACT, REUSED = 0, 1, 2
# DEFAULT_RATIO (imported above, re-exported by ragkv.blend) has its one home in ragkv.defaults
POSITION_BLOCKS = (
    4  # measured: 4 beats 1 and 8 for 16% scattered rows of 3K tokens (fewer, larger SDPA calls)
)


#: how the recomputed rows are chosen (docs/DEVIATIONS.md, "Beyond CacheBlend")
SELECTORS = ("kdev", "qattn", "mix", "qpass")
#: which stored rows get the per-chunk probe offset (AgentKVShift): none, K, V or both
OFFSETS = ("none", "k", "v", "kv")
#: the offset's per-row weight: 1, min(d, 1) (the paper) or min(d / median d of the chunk's probes, 1)
OFFSET_WEIGHTS = ("one", "cap", "norm")


@dataclass(frozen=True)
class BlendSchedule:
    """How a blend recomputes: which rows (selector, ratios, check layers) and how it corrects the rest.

    Gradual filtering: check layers with non-increasing recompute ratios (of the reused rows).
    """

    check_layers: tuple[int, ...] = (1,)
    ratios: tuple[float, ...] = (DEFAULT_RATIO,)
    #: "k", "v" or "kv": which fresh-vs-stored difference ranks tokens. K by default: on the real
    #: model (SmolLM2-135M, 30 layers) blend@0.15's first-token KL is 0.24x reuse's with K vs 0.38x
    #: with V (eval.bench_blend_schedule, MuSiQue; docs/DEVIATIONS.md); V won narrowly on the 5-layer
    #: tiny model only.
    deviation: str = "k"
    #: keep the *fresh* K/V of every candidate on check layers (the paper computes check layers fully)
    #: instead of the reused K/V of the rows not kept; False makes ratio 0 exactly full KV reuse
    fresh_check_kv: bool = False
    #: "kdev": CacheBlend's KV deviation at the check layer; "qattn": the question's attention at the
    #: check layer (A3); "mix": ``mix`` of the budget by question attention, the rest by deviation;
    #: "qpass": a question-only pass over the reused KV first, rows ranked by the question's attention
    #: averaged over ``score_layers`` (ProphetKV; InfoFlow with a deep band), recomputed from layer 0
    selector: str = "qpass"
    mix: float = 0.5
    #: qpass: the layers ``[lo, hi)`` whose question attention is averaged (None: every layer)
    score_layers: tuple[int, int] | None = None
    #: AgentKVShift: each chunk's mean fresh-minus-stored residual over its recomputed rows, per layer,
    #: added (weighted) to its rows that are not recomputed; "none", "k", "v" or "kv"
    offset: str = "k"
    offset_weight: str = "norm"
    #: a chunk's offset is applied only when at least this many of its rows were recomputed on the
    #: layer: a mean of one or two rows is noise (measured: two 7-token chunks degenerated into a loop)
    offset_min_probes: int = 4
    #: rows at the start of every reused chunk always recomputed (seam rows, EPIC's LegoLink-k), in the budget
    seam: int = 0
    #: APE: temperature T and scale S of the question's (and each decoded token's) attention to the
    #: reused chunks' rows (1, 1: off). Applied only while some reused row is not recomputed (ratio < 1)
    ape_temperature: float = 1.0
    ape_scale: float = 1.0

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
        for name, allowed in (
            ("selector", SELECTORS),
            ("offset", OFFSETS),
            ("offset_weight", OFFSET_WEIGHTS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}")
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError("mix must be in [0, 1]")
        if self.offset_min_probes < 1:
            raise ValueError("offset_min_probes must be >= 1")
        if self.seam < 0:
            raise ValueError("seam must be >= 0")
        if self.selector == "qpass" and (self.check_layers != (1,) or len(self.ratios) != 1):
            raise ValueError(
                "selector 'qpass' takes no check layers (it selects once, from a question pass, before "
                "layer 0); use selector='kdev' (or 'qattn', 'mix') for check layers or gradual filtering"
            )
        if self.score_layers is not None and not 0 <= self.score_layers[0] < self.score_layers[1]:
            raise ValueError("score_layers must be (lo, hi) with 0 <= lo < hi")
        if not 0.0 < self.ape_temperature <= 2.0 or self.ape_scale <= 0.0:
            raise ValueError("ape_temperature must be in (0, 2] and ape_scale > 0")

    def temper(self, context: torch.Tensor) -> ContextTemper | None:
        """APE's tempering of the attention to ``context`` rows (bool [n]); None when off or at ratio 1."""
        if (self.ape_temperature, self.ape_scale) == (1.0, 1.0) or self.target_ratio >= 1.0:
            return None
        return ContextTemper(self.ape_temperature, self.ape_scale, context)

    @classmethod
    def single(
        cls, ratio: float, check_layer: int = 1, deviation: str = "k", fresh_check_kv: bool = False, **options
    ) -> BlendSchedule:
        """One check layer at ``ratio``; ``options``: any other field (selector, offset, seam, ...)."""
        return cls((check_layer,), (ratio,), deviation, fresh_check_kv, **options)

    @property
    def target_ratio(self) -> float:
        return self.ratios[-1]

    def question_pass_costs_more(self, row_class: torch.Tensor) -> bool:
        """Whether a question pass over the prompt of ``row_class`` costs at least a full recompute of
        its reused rows: ``n_question >= (1 - ratio) * n_reused`` (short chunks beside a long question).
        Counted on the question's rows (after the last reused row) only, not on an uncached head's, so
        a query blends the same way whether the prefix cache is warm or not. Never at ratio 0, which
        stays plain reuse."""
        ratio = self.target_ratio
        reused = (row_class == REUSED).nonzero().flatten()
        if ratio <= 0.0 or reused.numel() == 0:
            return False
        n_question = int((row_class[int(reused[-1]) + 1 :] == COMPUTED).sum())
        return n_question >= (1.0 - ratio) * reused.numel()

    def options_key(self) -> str:
        """These blend options with the ratio left out: what a fidelity report's ladder (which varies
        the ratio alone) depends on, and so part of the report's identity."""
        return repr(replace(self, ratios=(1.0,)))


class BlendKV:
    """The K/V of a blend, one layer at a time (a ``LayerKV`` of :func:`ragkv.model.forward.run_layers`).

    Rows ``0 .. n-1`` of a prompt sit at positions ``0 .. n-1``. Per layer, every row's K/V is
    assembled from three places: ``stored`` (pre-RoPE K/V of ``stored_rows``, rotated here to their
    positions; REUSED rows are recompute candidates), ``posted(layer)`` (post-RoPE K/V of rows
    ``[0, n_posted)``, used as is: an engine's paged cache) and the rows the layer loop computes.
    :meth:`select` is the loop's row selector (at the schedule's check layers); ``preselected`` rows
    (a question pass's or an oracle's choice) are instead recomputed on every layer. With an offset
    option, the stored rows of each chunk that are not recomputed get the chunk's mean residual
    (fresh minus stored, over its recomputed rows) on each layer. The assembled layer goes to
    ``out_k/out_v[layer]`` when given (else a per-layer buffer) and to ``on_layer``.
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
        preselected: torch.Tensor | None = None,
        mass_rows: torch.Tensor | None = None,
        offset_oracle: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
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
        rc = row_class.to(dev)
        self.reused_mask = rc == REUSED
        self.n_reused = int(self.reused_mask.sum())
        self.stored_index = torch.full((self.n,), -1, dtype=torch.long, device=dev)
        self.stored_index[self.stored_rows] = torch.arange(self.stored_rows.numel(), device=dev)
        blending = schedule is not None and self.n_reused > 0
        self.schedule = schedule if blending else None
        self.preselected = preselected.to(dev) if preselected is not None and blending else None
        self.checks = (
            dict(zip(schedule.check_layers, schedule.ratios, strict=True))
            if blending and self.preselected is None
            else {}
        )
        self.out, self.on_layer = out, on_layer
        shape = (cfg.num_layers, min(int(keep_pre_rope), self.n), cfg.num_kv_heads, cfg.head_dim)
        self.k_pre = torch.empty(shape, dtype=model.dtype, device=dev) if shape[1] else None
        self.probe_rows = probe_rows.to(dev) if probe_rows is not None else None
        self.probes: list[torch.Tensor] | None = [] if probe_rows is not None else None
        #: per layer, the attention mass ``[n]`` that ``mass_rows`` (the question) put on each row
        self.mass_rows = mass_rows.to(dev) if mass_rows is not None else None
        self.mass: list[torch.Tensor] = []
        # chunk of every row (-1: not a reused row) and each row's place in its chunk
        self.segment, self.seg_pos, self.n_segments = _segments(self.n, self.stored_rows, stored, rc, dev)
        self.stored_seg = self.segment[self.stored_rows]
        self.offset = self.schedule.offset if self.schedule is not None else "none"
        self.temper = self.schedule.temper(self.reused_mask) if self.schedule is not None else None
        if self.preselected is not None and self.preselected.numel() >= self.n_reused:
            self.temper = None  # every reused row recomputed: nothing stale to temper (as at ratio 1)
        self.question = _question_rows(self.reused_mask, self.stored_index, self.n) if self.temper else None
        self.offset_oracle = offset_oracle if blending else None
        #: per stored row, the weight of its chunk's offset (set at the check layer; 1 without one)
        self.stored_w = torch.ones(self.stored_rows.numel(), dtype=torch.float32, device=dev)
        self._offsets: tuple[int, torch.Tensor | None, torch.Tensor | None] | None = None
        self.recomputed: list[int] = []
        self.final_rows: torch.Tensor | None = None
        self.t_select = 0.0
        self._layer = -1
        self._stored_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fresh: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._kv: tuple[torch.Tensor, torch.Tensor, bool] | None = None

    def first_rows(self, row_class: torch.Tensor) -> torch.Tensor:
        """Rows the loop starts with: every non-EXACT row when blending (the preselected and COMPUTED
        ones with a preselection), else the COMPUTED rows."""
        rc = row_class.to(self.dev)
        if self.schedule is None:
            return (rc == COMPUTED).nonzero().flatten()
        if self.preselected is not None:
            keep = rc == COMPUTED
            keep[self.preselected] = True
            return keep.nonzero().flatten()
        return (rc != EXACT).nonzero().flatten()

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
    def select(
        self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """At a check layer: the kept local indices of ``rows`` (all non-reused + the selector's top)."""
        stored = self.stored_layer(layer)
        if layer not in self.checks:
            return None
        if self.schedule.fresh_check_kv:  # keep every candidate's fresh K/V on this layer
            self._fresh = (rows, self.model.rope(k, rows), v)
        ts = time.perf_counter()
        keep = self._select(layer, rows, k, v, q, stored, self.checks[layer])
        self.t_select += time.perf_counter() - ts
        return keep

    def _select(self, layer, rows, k, v, q, stored, ratio) -> torch.Tensor:
        sched = self.schedule
        is_r = self.reused_mask[rows]
        cand = is_r.nonzero().flatten()
        keep_n = min(int(cand.numel()), int(round(ratio * self.n_reused)))
        ci = self.stored_index[rows[cand]]
        dk = (k[cand].float() - stored[0][ci].float()).pow(2).sum(dim=(1, 2))
        chosen = torch.zeros(cand.numel(), dtype=torch.bool, device=rows.device)
        if sched.seam and keep_n:
            chosen |= self.seg_pos[rows[cand]] < sched.seam
            if int(chosen.sum()) > keep_n:  # more seam rows than budget: the first ones
                chosen &= torch.cumsum(chosen.long(), 0) <= keep_n
        dev_score = torch.zeros_like(dk)
        if sched.deviation in ("v", "kv"):
            dev_score += (v[cand].float() - stored[1][ci].float()).pow(2).sum(dim=(1, 2))
        if sched.deviation in ("k", "kv"):
            # pre-RoPE vs pre-RoPE: rotations preserve norms, so this equals the post-RoPE deviation
            dev_score += dk
        left = keep_n - int(chosen.sum())
        if left > 0 and sched.selector in ("qattn", "mix"):
            q_score = self._question_attention(layer, rows, k, q, stored)[rows[cand]]
            n_q = left if sched.selector == "qattn" else int(round(sched.mix * left))
            chosen |= _top(q_score, chosen, n_q)
            left = keep_n - int(chosen.sum())
        if left > 0 and self.offset != "none":
            # AgentKVShift's probes are per chunk (its share of the budget, at least one), so that
            # every chunk's offset is estimated; a global top-k can leave a chunk without probes
            chosen |= _top_per_segment(dev_score, chosen, self.segment[rows[cand]], left)
        elif left > 0:
            chosen |= _top(dev_score, chosen, left)
        if self.offset != "none":  # the offset's row weights come from the K deviation here
            self.stored_w[ci] = _offset_weights(dk.sqrt(), self.stored_seg[ci], chosen, sched.offset_weight)
        keep = torch.cat([(~is_r).nonzero().flatten(), cand[chosen]])
        return keep.sort().values

    def _question_attention(self, layer, rows, k, q, stored) -> torch.Tensor:
        """A3's score at a check layer: the question rows' attention ``[n]`` over every row, smoothed."""
        if q is None:
            raise ValueError("the question-attention selector needs the layer's queries")
        qrows = _question_rows(self.reused_mask, self.stored_index, self.n)
        K = k.new_zeros(self.n, *k.shape[1:])
        if stored is not None:
            K[self.stored_rows] = self.model.rope(stored[0], self.stored_rows, self.stored_tables)
        if self.n_posted:
            K[: self.n_posted] = self.posted(layer)[0]
        K[rows] = self.model.rope(k, rows)
        local = torch.searchsorted(rows, qrows)
        qq = self.model.rope(q[local], qrows)
        probs = attention_probs(qq, K, qrows, self.pos, self.model.scale, self.model.config.window(layer))
        score = probs.sum(dim=(0, 1))
        # A3 smooths the score with a width-5 average (neighbours of a relevant token are relevant)
        return torch.nn.functional.avg_pool1d(score[None, None], 5, 1, 2, count_include_pad=False)[0, 0]

    def on_pre_rope(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Counts the rows computed on ``layer``; keeps the pre-RoPE K of rows ``< keep_pre_rope``; the
        per-chunk offsets of the layer from its recomputed reused rows."""
        self.recomputed.append(int(rows.numel()))
        self.final_rows = rows
        stored = self.stored_layer(layer)
        if (self.offset != "none" or self.offset_oracle is not None) and rows.numel() < self.n:
            self._offsets = (layer, *self._chunk_offsets(layer, rows, k, v, stored))
        if self.k_pre is None:
            return
        m = self.k_pre.shape[1]
        head = self.stored_rows[self.stored_rows < m]
        if stored is not None and head.numel():
            self.k_pre[layer, head] = stored[0][: head.numel()]
        j = int(torch.searchsorted(rows, m))
        self.k_pre[layer, rows[:j]] = k[:j]

    def _chunk_offsets(self, layer, rows, k, v, stored) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per chunk, the mean pre-RoPE residual ``[n_segments, Hkv, D]`` of K and of V (None: not used)."""
        if self.offset_oracle is not None:  # diagnostics: the true residual of every row of the chunk
            res_k, res_v = self.offset_oracle(layer)
            seg = self.stored_seg
        else:
            loc = self.reused_mask[rows].nonzero().flatten()
            si = self.stored_index[rows[loc]]
            res_k = k[loc].float() - stored[0][si].float()
            res_v = v[loc].float() - stored[1][si].float()
            seg = self.stored_seg[si]
        sel = seg >= 0
        seg, res_k, res_v = seg[sel], res_k[sel], res_v[sel]
        n = torch.bincount(seg, minlength=self.n_segments)
        count = n.clamp(min=1).float()[:, None, None]
        # too few probes: no offset for that chunk (the oracle's true mean is never too small)
        enough = (n >= (1 if self.offset_oracle is not None else self.schedule.offset_min_probes)).float()

        def mean(res: torch.Tensor) -> torch.Tensor:
            z = res.new_zeros(self.n_segments, *res.shape[1:]).float()
            return z.index_add_(0, seg, res.float()) / count * enough[:, None, None]

        mode = "kv" if self.offset_oracle is not None else self.offset
        return (mean(res_k) if "k" in mode else None), (mean(res_v) if "v" in mode else None)

    # ---- LayerKV ---------------------------------------------------------------------------------
    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Assembles the layer's K/V of every row: stored (re-rotated, offset), posted, fresh check rows, computed."""
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
                sk, sv = self._corrected(layer, *stored)
                K[self.stored_rows] = self.model.rope(sk, self.stored_rows, self.stored_tables)
                V[self.stored_rows] = sv
            if self.n_posted:
                Kp, Vp = self.posted(layer)
                K[: self.n_posted], V[: self.n_posted] = Kp, Vp
            if self._fresh is not None:
                K[self._fresh[0]], V[self._fresh[0]] = self._fresh[1], self._fresh[2]
            K[rows], V[rows] = k, v
        self._kv = (K, V, full)
        if self.on_layer is not None:
            self.on_layer(layer, K, V)

    def _corrected(self, layer: int, sk: torch.Tensor, sv: torch.Tensor):
        """Stored pre-RoPE K/V plus each chunk's weighted offset of this layer (as stored without one)."""
        if self._offsets is None or self._offsets[0] != layer:
            return sk, sv
        _, mu_k, mu_v = self._offsets
        seg = self.stored_seg
        w = torch.where(seg >= 0, self.stored_w, torch.zeros_like(self.stored_w))[:, None, None]
        idx = seg.clamp(min=0)
        if mu_k is not None:
            sk = (sk.float() + w * mu_k[idx]).to(sk.dtype)
        if mu_v is not None:
            sv = (sv.float() + w * mu_v[idx]).to(sv.dtype)
        return sk, sv

    def attend(self, layer: int, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Attention of the computed rows over every row of the layer (position blocks when scattered)."""
        K, V, full = self._kv
        if self.probes is not None:
            local = torch.searchsorted(rows, self.probe_rows)
            self.probes.append(
                attention_probs(
                    q[local], K, self.probe_rows, self.pos, self.model.scale, self.model.config.window(layer)
                )
            )
        if self.mass_rows is not None:
            window = self.model.config.window(layer)
            if self.temper is None and torch.equal(rows, self.mass_rows):
                # a question pass over a warm head: the question's rows are every computed row, so one
                # explicit pass gives both their attention and the mass they put on each row
                out, mass = explicit_attention(q, K, V, rows, self.pos, self.model.scale, window)
                self.mass.append(mass)
                return out
            local = torch.searchsorted(rows, self.mass_rows)
            probs = attention_probs(q[local], K, self.mass_rows, self.pos, self.model.scale, window)
            self.mass.append(probs.sum(dim=(0, 1)))
        out = self.model.attend(
            layer,
            q,
            K,
            V,
            rows,
            self.pos,
            contiguous=full,
            position_blocks=0 if full else POSITION_BLOCKS,
        )
        if self.temper is not None and self.question.numel():
            # APE: the question rows' attention to the reused chunks, tempered (chunk rows are not)
            local = torch.searchsorted(rows, self.question)
            window = self.model.config.window(layer)
            out[local] = explicit_attention(
                q[local], K, V, self.question, self.pos, self.model.scale, window, self.temper
            )[0]
        return out

    def stats(self) -> dict:
        """Rows recomputed per layer and time spent selecting / waiting for stored KV."""
        return {
            "recomputed_per_layer": self.recomputed,
            "t_select_s": self.t_select,
            "t_load_wait_s": getattr(self.stored, "wait_s", 0.0) if self.stored is not None else 0.0,
        }


def _segments(n: int, stored_rows: torch.Tensor, stored, row_class: torch.Tensor, dev):
    """``(segment [n], position in segment [n], count)``: the stored piece (chunk) of every REUSED row.

    Pieces come from the source's ``pieces`` (one per stored chunk or cached head); without them, each
    run of consecutive stored rows is one segment. Rows that are not REUSED get segment -1.
    """
    m = int(stored_rows.numel())
    seg = torch.full((n,), -1, dtype=torch.long, device=dev)
    pos = torch.zeros(n, dtype=torch.long, device=dev)
    if m == 0:
        return seg, pos, 0
    pieces = getattr(stored, "pieces", None)
    lengths = [int(p.num_tokens) for p in pieces] if pieces else []
    if sum(lengths) >= m:
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:m].to(dev)
    else:
        ids = torch.cumsum(torch.cat([stored_rows.new_ones(1), (stored_rows.diff() != 1).long()]), 0) - 1
    starts = torch.zeros(int(ids.max()) + 1, dtype=torch.long, device=dev)
    starts.scatter_reduce_(0, ids, stored_rows, reduce="amin", include_self=False)
    seg[stored_rows] = ids
    pos[stored_rows] = stored_rows - starts[ids]
    seg[row_class != REUSED] = -1
    return seg, pos, int(ids.max()) + 1


def _question_rows(reused_mask: torch.Tensor, stored_index: torch.Tensor, n: int) -> torch.Tensor:
    """The question: the computed rows after the last reused row (the prompt's suffix)."""
    last = int(reused_mask.nonzero().max()) if bool(reused_mask.any()) else -1
    rows = torch.arange(last + 1, n, device=reused_mask.device)
    return rows[stored_index[rows] < 0]


def _top(score: torch.Tensor, taken: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the ``k`` highest ``score`` entries not already ``taken``."""
    out = torch.zeros_like(taken)
    if k <= 0:
        return out
    s = score.masked_fill(taken, float("-inf"))
    k = min(k, int((~taken).sum()))
    out[s.topk(k).indices] = True
    return out


def _top_per_segment(score: torch.Tensor, taken: torch.Tensor, seg: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the highest ``score`` entries of each segment, ``k`` split by segment size (>= 1 each)."""
    out = torch.zeros_like(taken)
    free = ~taken
    n_free = int(free.sum())
    if k <= 0 or n_free == 0:
        return out
    for s in seg[free].unique().tolist():
        m = (seg == s) & free
        share = max(1, int(round(k * int(m.sum()) / n_free)))
        out |= _top(score, ~m, share)
    return out


def _offset_weights(d: torch.Tensor, seg: torch.Tensor, probe: torch.Tensor, how: str) -> torch.Tensor:
    """AgentKVShift's per-row weight of the chunk offset from each row's check-layer K deviation ``d``.

    "cap" is the paper's ``min(d, 1)`` (scale-dependent: raw L2); "norm" divides by the median ``d``
    of the chunk's probes (its recomputed rows) first; "one" weights every row 1.
    """
    if how == "one":
        return torch.ones_like(d)
    if how == "cap":
        return d.clamp(max=1.0)
    out = torch.ones_like(d)
    for s in seg.unique().tolist():
        m = seg == s
        ref = d[m & probe]
        if ref.numel():
            out[m] = (d[m] / ref.median().clamp(min=1e-6)).clamp(max=1.0)
    return out


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


class HeldLayers:
    """A source read once and held, so a second pass over the layers reads memory (the question pass)."""

    def __init__(self, source):
        self.source = source
        self.pieces = getattr(source, "pieces", None)
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.wait_s = 0.0

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.layers:
            self.layers[layer] = self.source.layer(layer)
            self.wait_s = getattr(self.source, "wait_s", 0.0)
        return self.layers[layer]

    def close(self) -> None:
        """Kept open for the next pass; :meth:`release` closes the underlying source."""

    def release(self) -> None:
        self.layers.clear()
        self.source.close()


def qpass_rows(
    model, token_ids, row_class, source, schedule: BlendSchedule
) -> tuple[torch.Tensor, list[int]]:
    """The ``qpass`` selector's choice, for serving and for training alike: ``(reused rows to recompute
    on every layer, rows the question pass computed per layer)``.

    ProphetKV / InfoFlow: the question alone over the reused KV; the reused rows it attends to most,
    ranked by the question's attention mass averaged over ``schedule.score_layers``, seam rows first.
    Every reused row, and no pass, when the pass would cost more than that
    (:meth:`BlendSchedule.question_pass_costs_more`: exact, and cheaper).
    """
    if schedule.question_pass_costs_more(row_class):
        return (row_class == REUSED).nonzero().flatten(), []
    reused = (row_class == REUSED).to(model.device)
    kv = BlendKV(
        model, row_class, None, stored=source, stored_rows=(row_class != COMPUTED).nonzero().flatten()
    )
    # rows whose attention mass (the question's, per layer) the pass records
    kv.mass_rows = _question_rows(kv.reused_mask, kv.stored_index, kv.n)
    blend_layers(model, token_ids, row_class, kv, last_layer_attention=True)
    lo, hi = schedule.score_layers or (0, model.config.num_layers)
    score = torch.stack(kv.mass[lo:hi]).mean(dim=0)
    cand = reused.nonzero().flatten()
    keep_n = min(int(cand.numel()), int(round(schedule.target_ratio * cand.numel())))
    chosen = torch.zeros(cand.numel(), dtype=torch.bool, device=model.device)
    if schedule.seam and keep_n:
        chosen |= kv.seg_pos[cand] < schedule.seam
        chosen &= torch.cumsum(chosen.long(), 0) <= keep_n
    chosen |= _top(score[cand], chosen, keep_n - int(chosen.sum()))
    return cand[chosen], kv.recomputed


@torch.inference_mode()
def selective_prefill(
    model,
    token_ids: torch.Tensor,
    row_class: torch.Tensor,
    source=None,
    schedule: BlendSchedule | None = None,
    probe_rows: torch.Tensor | None = None,
    keep_pre_rope: int = 0,
    preselected: torch.Tensor | None = None,
    offset_oracle: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> PrefillResult:
    """Prefill a prompt whose cached rows come from ``source`` (every prefill mode; see the module doc).

    ``source.layer(l)`` gives pre-RoPE K/V of the EXACT/REUSED rows in order. ``keep_pre_rope=m``
    also returns the pre-RoPE K of the first ``m`` rows (``kv.k_pre [L, m, ...]``) for prefix-cache
    inserts; only exactly computed rows may be inserted, which the caller ensures. Diagnostics:
    ``preselected`` reused rows are recomputed on every layer instead of a selector's choice, and
    ``offset_oracle(layer)`` gives the true pre-RoPE residuals ``(k, v) [n_stored, Hkv, D]`` of the
    stored rows whose per-chunk means replace the estimated offsets.
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
    pass_rows: list[int] = []
    held = None
    blending = schedule is not None and bool((row_class == REUSED).any())
    if blending and schedule.selector == "qpass" and preselected is None:
        if not schedule.question_pass_costs_more(row_class):  # a pass, then the blend: the source read once
            held = source = HeldLayers(source)
        try:
            preselected, pass_rows = qpass_rows(model, token_ids, row_class, source, schedule)
        except BaseException:
            # a failed load: the underlying source (a loader thread) is closed all the same
            if held is not None:
                held.release()
            raise
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
        preselected=preselected,
        offset_oracle=offset_oracle,
    )
    try:
        h = blend_layers(model, token_ids, row_class, kv)
    finally:
        if held is not None:
            held.release()
    logits = model.logits(h[-1:])[0].float()
    recomputed = kv.recomputed
    # charged compute: rows x layers of every pass (the question pass included), over a full prefill's
    charged = sum(recomputed) + sum(pass_rows)
    stats = {
        "num_tokens": n,
        "num_computed_rows": int((row_class == COMPUTED).sum()),
        "num_exact_rows": int((row_class == EXACT).sum()),
        "num_reused_rows": kv.n_reused,
        "recompute_fraction": charged / (cfg.num_layers * n),
        "question_pass_rows": sum(pass_rows),
        **kv.stats(),
        "t_prefill_s": time.perf_counter() - t_start,
    }
    if kv.final_rows is not None:
        stats["recomputed_rows_last_layer"] = kv.final_rows
    pos = torch.arange(n, device=dev)
    prompt_kv = PromptKV(out_k, out_v, pos, token_ids.to(dev), kv.k_pre)
    return PrefillResult(logits, prompt_kv, stats, kv.probes, kv.temper)
