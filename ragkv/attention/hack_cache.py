"""HackKVCache: the decode KV cache with 2-bit (or 3/4/8-bit) K/V and homomorphic attention (HACK).

Each layer keeps, for one sequence:

* quantized K rows (per token, along head_dim, partitions of ``min(Pi, D)`` channels) with fp16
  scale/min and cached code sums; K is quantized as soon as a row leaves the fp16 regions below
  (the paper quantizes every new K immediately: ``recent_window=0``);
* quantized V partitions (per channel, along ``Pi`` consecutive tokens) with fp16 scale/min and sums;
* the fp16 V tail: V of quantized-K rows not yet forming a full partition (requantization elimination);
* optional fp16 rows (not in the paper, error reduction at low bit widths): the first ``sink_tokens``
  rows (attention sinks, as the public HKVQ code does) and the ``recent_window`` newest rows.

``k_smooth`` (not in the paper) stores quantized K rows minus a per-channel mean (``"mean"``),
optionally divided by the per-channel absolute max (``"mean_scale"``, Q is multiplied by it instead).
Subtracting a per-channel constant from every key shifts each query's scores by one constant, which
softmax ignores; the scaling is an exact re-basing of ``q . k``. Both shrink the per-token ranges that
outlier channels would otherwise blow up. The statistics are fixed once per layer, when its first K
rows are quantized, from every row seen so far (so a bulk prompt write gives whole-prompt statistics);
fp16 rows stay raw and their scores use ``q . (k - mean)`` so all scores share the same shift.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace

import torch
from torch import Tensor

from ragkv.attention.dense import layer_windows
from ragkv.attention.hack_quant import (
    DEFAULT_CLIP_RATIOS,
    HackConfigError,
    HackError,
    KeyPlan,
    check_bits,
    check_kv_rows,
    check_partition,
    k_partition_size,
    packed_width,
    parts_width,
    quantize_k_rows,
    quantize_v_partitions,
    sum_dtype,
)
from ragkv.attention.hack_ref import BACKENDS, HackLayerView, hack_attention
from ragkv.attention.kvcache import KVCache, cache_geometry

K_SMOOTH_MODES = ("none", "mean", "mean_scale")
K_PLANS = ("uniform", "rope")


def smooth_stats(rows: Tensor, mode: str) -> tuple[Tensor | None, Tensor | None]:
    """K smoothing statistics ``(shift, div)`` ``[Hkv, D]`` of K rows ``[T, Hkv, D]`` (see the module docstring).

    fp32 tensors holding fp16 values (they are stored in fp16); ``div`` is None unless ``"mean_scale"``.
    The one definition shared by :class:`HackKVCache` and the engine's paged HACK blocks.
    """
    if mode not in K_SMOOTH_MODES:
        raise HackConfigError(f"k_smooth must be one of {K_SMOOTH_MODES}, got {mode!r}")
    if mode == "none":
        return None, None
    rows = rows.float()
    shift = rows.mean(0).half().float()
    if mode != "mean_scale":
        return shift, None
    amax = (rows - shift).abs().amax(0)
    return shift, torch.where(amax > 1e-3, amax, torch.ones_like(amax)).half().float()


class HackCacheError(HackError):
    """Bad input to the HACK cache (shapes, dtypes, positions, layer index)."""


def check_key_plans(
    cfg: HackConfig, plans: Sequence[KeyPlan] | None, layers: int, hkv: int, head_dim: int
) -> None:
    """``k_plan="rope"`` takes one :class:`KeyPlan` per layer, of this geometry and ``k_bits`` on
    average; ``"uniform"`` takes none."""
    if cfg.k_plan == "uniform":
        if plans is not None:
            raise HackConfigError('key plans given with k_plan="uniform"')
        return
    if plans is None or len(plans) != layers:
        raise HackConfigError(
            f'k_plan="rope" needs one calibrated KeyPlan per layer ({layers}); got '
            f"{'none' if plans is None else len(plans)} (ragkv.model.rope_energy.hack_key_plans)"
        )
    parts = head_dim // cfg.k_part(head_dim)
    for i, p in enumerate(plans):
        if tuple(p.order.shape) != (hkv, head_dim) or len(p.bits) != parts:
            raise HackConfigError(f"key plan of layer {i} does not fit {hkv} kv heads x {parts} K partitions")
        if p.mean_bits != cfg.key_bits:
            raise HackConfigError(
                f"key plan of layer {i} averages {p.mean_bits} bits, not k_bits={cfg.key_bits}"
            )


@dataclass(frozen=True)
class HackConfig:
    """Settings of the HACK cache. Defaults are the paper's scheme (see docs/HACK.md for measurements)."""

    bits: int = 2  # K and V code bits: 2 (paper), 3, 4 or 8
    k_bits: int | None = None  # K's (average) code bits if different from ``bits`` (V's)
    k_plan: str = "uniform"  # "uniform" | "rope": RoPE-aware K bits per partition (KeyPlan)
    partition: int = 64  # Pi: V tokens per partition; K channels per partition, capped at head_dim
    k_partition: int | None = None  # K channels per partition if different from ``partition``
    qp_bits: int = 8  # bits of the transient Q and softmax P codes
    stochastic: bool = False  # stochastic rounding of K/V (paper); nearest measured better, see HACK.md
    seed: int = 0  # seed of the stochastic-rounding generator
    sink_tokens: int = 0  # first rows kept in fp16 (K and V); HKVQ code default is 4
    recent_window: int = 0  # newest rows kept in fp16 (K and V) before being quantized
    clip_search: bool = False  # MSE-searched clipping of each K/V partition's range
    k_smooth: str = "none"  # "none" | "mean" | "mean_scale" (see module docstring)
    backend: str = "float"  # CPU reference integer products: "float" (exact fp32) or "int" (int64)
    use_triton: bool = True  # use the Triton decode kernel for single-token CUDA decode when possible

    def __post_init__(self):
        check_bits(self.bits)
        check_partition(self.partition)
        if self.k_partition is not None:
            check_partition(self.k_partition)
        if self.qp_bits != 8:
            check_bits(self.qp_bits)
        if self.sink_tokens < 0 or self.recent_window < 0:
            raise HackConfigError("sink_tokens and recent_window must be >= 0")
        if self.k_bits is not None:
            check_bits(self.k_bits)
        for name, allowed in (("k_smooth", K_SMOOTH_MODES), ("backend", BACKENDS), ("k_plan", K_PLANS)):
            if getattr(self, name) not in allowed:
                raise HackConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

    @property
    def key_bits(self) -> int:
        """K's code bits (the average over partitions with ``k_plan="rope"``)."""
        return self.k_bits or self.bits

    @property
    def uniform_keys(self) -> bool:
        """K and V share one code width in the model's channel order (what paged layouts store)."""
        return self.k_plan == "uniform" and self.key_bits == self.bits

    def k_part(self, head_dim: int) -> int:
        """Effective K partition size for ``head_dim``."""
        return k_partition_size(head_dim, self.k_partition or self.partition)

    @property
    def clip_ratios(self) -> tuple[float, ...] | None:
        return DEFAULT_CLIP_RATIOS if self.clip_search else None

    def rounding(self, generator: torch.Generator | None) -> dict:
        """The K/V quantizers' rounding options: stochastic (drawing from ``generator``) or nearest,
        and the clip search (``quantize_k_rows(..., **cfg.rounding(gen))``)."""
        return {"stochastic": self.stochastic, "generator": generator, "clip_ratios": self.clip_ratios}

    @classmethod
    def preset(cls, name: str, **overrides) -> HackConfig:
        """A named configuration: ``"paper"`` (HACK's scheme, the defaults) or ``"accurate"``.

        ``"accurate"`` adds the error reductions measured in docs/HACK.md (fp16 attention sinks and
        recent window, K smoothing, MSE-searched clipping); it costs a constant number of fp16 rows
        per layer and a slower quantization step, and keeps the 2-bit codes and Eq. (4) unchanged.
        """
        if name not in PRESETS:
            raise HackConfigError(f"unknown HACK preset {name!r}; known: {sorted(PRESETS)}")
        return replace(cls(**PRESETS[name]), **overrides)

    @classmethod
    def from_options(cls, config: HackConfig | None = None, **options) -> HackConfig:
        """Build from keyword options (``hack_`` prefixes accepted, e.g. ``hack_bits=4``) over ``config``.

        ``preset="accurate"`` starts from a named preset instead of the defaults.
        """
        names = {f.name for f in fields(cls)}
        clean = {}
        base = config
        for key, val in options.items():
            name = key.removeprefix("hack_")
            if name == "preset":
                base = cls.preset(val)
                continue
            if name not in names:
                raise HackConfigError(f"unknown HACK option {key!r}; known: {sorted(names | {'preset'})}")
            clean[name] = val
        return replace(base or cls(), **clean)


PRESETS: dict[str, dict] = {
    "paper": {},
    "accurate": {"sink_tokens": 4, "recent_window": 16, "k_smooth": "mean_scale", "clip_search": True},
    # accurate + RoPE-aware 3-bit keys over 2-bit values: 2.5 code bits per element. On the real
    # default model K carries the 2-bit error (K4V2 KL 0.03 vs K2V4 0.20); 4 bits on the
    # higher-energy half of each head's RoPE blocks and 2 on the rest measured KL 0.036 where
    # uniform 3-bit keys gave 0.064 (docs/HACK.md, "RoPE-aware key bits").
    "rope": {
        "sink_tokens": 4,
        "recent_window": 16,
        "k_smooth": "mean_scale",
        "clip_search": True,
        "k_bits": 3,
        "k_plan": "rope",
        "k_partition": 32,
    },
}


#: HACK's defaults on every surface (``generate``/``LLM`` with ``attention="hack"``, the engine's
#: pages): the ``rope`` preset with a 32-row fp16 recent window. On SmolLM2-135M: first-token KL
#: 0.036 vs fp16 in the per-sequence cache (the paper's 2-bit scheme: 2.6) and 0.034 on the engine's
#: pages (2-bit keys with the same controls: 0.117), for 17% more bytes than 2-bit keys (docs/HACK.md,
#: docs/BENCHMARKS.md "RoPE-aware key bits"). Heads too narrow for two 32-channel K partitions
#: (head_dim < 64), or options that set code widths (``bits``, ``k_bits``, ``k_plan``), get
#: :data:`UNIFORM_KEYS`. A named preset replaces both (``preset="paper"``: HACK's own scheme,
#: ``HackConfig()``'s).
DEFAULTS = {"preset": "rope", "recent_window": 32}
UNIFORM_KEYS = {"preset": "accurate", "k_partition": 64, "recent_window": 32}


def default_config(
    options: dict, head_dim: int, partition: int | None = None, preset_k_partition: int | None = None
) -> HackConfig:
    """The :class:`HackConfig` a surface uses for ``options`` (``hack_`` prefixes accepted): a
    ``config`` given as is, a named preset as it is, else :data:`DEFAULTS` / :data:`UNIFORM_KEYS`;
    then the options over it. ``partition``: the V partition a surface fixes (the engine's block
    size); ``preset_k_partition``: the K partition of a named preset that names none (the engine's 64).
    """
    options = dict(options)
    config = options.pop("config", None)
    fixed = {"partition": partition} if partition else {}
    if config is not None:
        return HackConfig.from_options(config, **fixed, **options)
    preset = options.get("preset", options.get("hack_preset"))
    if preset is not None:
        named = PRESETS.get(preset, {}).get("k_partition", preset_k_partition)
        base = {"k_partition": named} if named else {}
    else:
        sets_widths = {"bits", "k_bits", "k_plan"} & {k.removeprefix("hack_") for k in options}
        base = DEFAULTS if head_dim >= 64 and not sets_widths else UNIFORM_KEYS
    return HackConfig.from_options(**{**base, **fixed, **options})


class _Buf:
    """An append-only tensor with doubling capacity along dim 0."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, capacity: int = 16):
        self.data = torch.empty((capacity, *shape), dtype=dtype, device=device)
        self.n = 0

    def append(self, x: Tensor) -> None:
        need = self.n + x.shape[0]
        if need > self.data.shape[0]:
            grown = torch.empty(
                (max(need, 2 * self.data.shape[0]), *self.data.shape[1:]),
                dtype=self.data.dtype,
                device=self.data.device,
            )
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[self.n : need] = x
        self.n = need

    def view(self) -> Tensor:
        return self.data[: self.n]

    def nbytes(self) -> int:
        return self.view().numel() * self.data.element_size()


class _LayerStore:
    """All tensors of one layer (see the module docstring for the regions)."""

    def __init__(self, hkv: int, d: int, cfg: HackConfig, device: torch.device, plan: KeyPlan | None):
        pk = cfg.k_part(d)
        #: code bits per K partition, and the channel order per KV head (RoPE-aware keys)
        self.k_bits = plan.bits if plan else (cfg.key_bits,) * (d // pk)
        self.k_order = plan.order.to(device) if plan else None
        pw = packed_width(d, cfg.bits)
        ksd, vsd = sum_dtype(max(self.k_bits), pk), sum_dtype(cfg.bits, cfg.partition)
        self.k_packed = _Buf((hkv, parts_width(self.k_bits, pk)), torch.uint8, device)
        self.k_scale = _Buf((hkv, d // pk), torch.float16, device)
        self.k_min = _Buf((hkv, d // pk), torch.float16, device)
        self.k_sum = _Buf((hkv, d // pk), ksd, device)
        self.k_pos = _Buf((), torch.long, device)
        self.v_packed = _Buf((hkv, pw), torch.uint8, device)
        self.v_scale = _Buf((hkv, d), torch.float16, device, 1)
        self.v_min = _Buf((hkv, d), torch.float16, device, 1)
        self.v_sum = _Buf((hkv, d), vsd, device, 1)
        empty = torch.empty(0, hkv, d, dtype=torch.float16, device=device)
        self.v_tail = empty
        self.sink_k, self.sink_v = empty, empty
        self.sink_pos = torch.empty(0, dtype=torch.long, device=device)
        self.win_k, self.win_v, self.win_pos = empty, empty, self.sink_pos
        self.k_shift: Tensor | None = None  # [Hkv, D] fp32 holding fp16 values (K smoothing mean)
        self.k_div: Tensor | None = None  # [Hkv, D] fp32 holding fp16 values (K divisor = Q multiplier)
        self.rows = 0

    def view(self, cfg: HackConfig, d: int) -> HackLayerView:
        dense_k = torch.cat([self.sink_k, self.win_k])
        return HackLayerView(
            bits=cfg.bits,
            k_part=cfg.k_part(d),
            v_part=cfg.partition,
            head_dim=d,
            k_packed=self.k_packed.view(),
            k_scale=self.k_scale.view(),
            k_min=self.k_min.view(),
            k_sum=self.k_sum.view(),
            k_pos=self.k_pos.view(),
            v_packed=self.v_packed.view(),
            v_scale=self.v_scale.view(),
            v_min=self.v_min.view(),
            v_sum=self.v_sum.view(),
            v_tail=self.v_tail,
            dense_k=dense_k,
            dense_v=torch.cat([self.sink_v, self.win_v]),
            dense_pos=torch.cat([self.sink_pos, self.win_pos]),
            k_shift=self.k_shift,
            q_mul=self.k_div,
            k_bits=None if set(self.k_bits) == {cfg.bits} else self.k_bits,
            k_order=self.k_order,
        )

    def nbytes(self) -> dict[str, int]:
        fp16_rows = self.v_tail.numel() + 2 * (self.sink_k.numel() + self.win_k.numel())
        stats = sum(t.numel() * 2 for t in (self.k_shift, self.k_div) if t is not None)
        return {
            "codes": self.k_packed.nbytes() + self.v_packed.nbytes(),
            "scales_mins": sum(b.nbytes() for b in (self.k_scale, self.k_min, self.v_scale, self.v_min)),
            "sums": self.k_sum.nbytes() + self.v_sum.nbytes(),
            "fp16_rows": fp16_rows * 2,
            "smooth_stats": stats,
        }


class HackKVCache(KVCache):
    """Decode KV cache of one sequence with HACK-quantized K/V and homomorphic attention."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        config: HackConfig | None = None,
        device: str | torch.device = "cpu",
        sliding_window: int | None | tuple[int | None, ...] = None,
        key_plans: Sequence[KeyPlan] | None = None,
    ):
        self.config = config or HackConfig()
        self.config.k_part(head_dim)  # validates head_dim against the K partition
        check_key_plans(self.config, key_plans, num_layers, num_kv_heads, head_dim)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        #: per layer: its sliding window (None: full causal)
        self.windows = layer_windows(sliding_window, num_layers)
        self.device = torch.device(device)
        self._layers = [
            _LayerStore(num_kv_heads, head_dim, self.config, self.device, key_plans[i] if key_plans else None)
            for i in range(num_layers)
        ]
        self._gen = torch.Generator().manual_seed(self.config.seed)

    @classmethod
    def for_model(
        cls, model, config: HackConfig | None = None, key_plans: Sequence[KeyPlan] | None = None, **options
    ) -> HackKVCache:
        """A cache matching ``model``'s geometry; ``options`` are HackConfig fields (``hack_`` prefix ok).

        ``k_plan="rope"`` needs the model's calibrated ``key_plans``
        (:func:`ragkv.model.rope_energy.hack_key_plans`; ``ragkv.generate.make_cache`` passes them).
        """
        cfg = HackConfig.from_options(config, **options)
        return cls(**cache_geometry(model), config=cfg, key_plans=key_plans)

    # ---- writing ----------------------------------------------------------------------------------
    def _check_write(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise HackCacheError(f"layer {layer} out of range [0, {self.num_layers})")
        check_kv_rows(k, v, self.num_kv_heads, self.head_dim, HackCacheError)
        if positions.dim() != 1 or positions.numel() != k.shape[0]:
            raise HackCacheError(f"positions must be [n={k.shape[0]}], got {tuple(positions.shape)}")
        if positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise HackCacheError(f"positions must be integers, got {positions.dtype}")

    def _smooth_stats(self, st: _LayerStore, k_new: Tensor) -> None:
        """Fix the layer's K smoothing statistics from every row seen so far (first quantization only)."""
        if self.config.k_smooth == "none" or st.k_shift is not None:
            return
        st.k_shift, st.k_div = smooth_stats(torch.cat([st.sink_k, st.win_k, k_new]), self.config.k_smooth)

    def _smoothed(self, st: _LayerStore, k16: Tensor) -> Tensor:
        """K rows in the smoothing basis (fp32); identity without smoothing."""
        out = k16.float()
        if st.k_shift is not None:
            out = out - st.k_shift
        if st.k_div is not None:
            out = out / st.k_div
        return out

    def write(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Append rows ``k, v [n, Hkv, D]`` (post-RoPE K) at ``positions [n]``; all-or-nothing on bad input."""
        self._check_write(layer, positions, k, v)
        n = k.shape[0]
        if n == 0:
            return
        cfg = self.config
        st = self._layers[layer]
        pos = positions.to(self.device, torch.long)
        k16 = k.to(self.device, torch.float16)
        v16 = v.to(self.device, torch.float16)
        n_sink = max(0, min(n, cfg.sink_tokens - st.rows))
        if n_sink:
            st.sink_k = torch.cat([st.sink_k, k16[:n_sink]])
            st.sink_v = torch.cat([st.sink_v, v16[:n_sink]])
            st.sink_pos = torch.cat([st.sink_pos, pos[:n_sink]])
        st.rows += n
        k16, v16, pos = k16[n_sink:], v16[n_sink:], pos[n_sink:]
        if not pos.numel():
            return
        # Through the fp16 recent window: the oldest rows beyond ``recent_window`` leave it.
        wk, wv, wp = torch.cat([st.win_k, k16]), torch.cat([st.win_v, v16]), torch.cat([st.win_pos, pos])
        out = max(0, wp.numel() - cfg.recent_window)
        st.win_k, st.win_v, st.win_pos = wk[out:], wv[out:], wp[out:]
        if out:
            self._quantize_rows(st, wk[:out], wv[:out], wp[:out])

    def _quantize_rows(self, st: _LayerStore, k16: Tensor, v16: Tensor, pos: Tensor) -> None:
        """Quantize K rows now; move V into the fp16 tail and flush whole partitions of it."""
        cfg = self.config
        gen = self._gen if cfg.stochastic else None
        self._smooth_stats(st, k16)
        ks = self._smoothed(st, k16)
        if st.k_order is not None:  # RoPE-aware keys: stored in the plan's channel order
            ks = ks.gather(-1, st.k_order.expand_as(ks))
        packed, scale, mn, sums = quantize_k_rows(
            ks, st.k_bits, cfg.k_part(self.head_dim), **cfg.rounding(gen)
        )
        st.k_packed.append(packed)
        st.k_scale.append(scale)
        st.k_min.append(mn)
        st.k_sum.append(sums)
        st.k_pos.append(pos)
        tail = torch.cat([st.v_tail, v16])
        full = (tail.shape[0] // cfg.partition) * cfg.partition
        if full:
            vp, vs, vm, vsum = quantize_v_partitions(
                tail[:full].float(), cfg.bits, cfg.partition, **cfg.rounding(gen)
            )
            st.v_packed.append(vp)
            st.v_scale.append(vs)
            st.v_min.append(vm)
            st.v_sum.append(vsum)
        st.v_tail = tail[full:].clone()

    # ---- reading ----------------------------------------------------------------------------------
    def layer_view(self, layer: int) -> HackLayerView:
        """The live tensors of ``layer`` (for the reference, the Triton kernel and tests)."""
        if not 0 <= layer < self.num_layers:
            raise HackCacheError(f"layer {layer} out of range [0, {self.num_layers})")
        return self._layers[layer].view(self.config, self.head_dim)

    def attend(self, layer: int, q: Tensor, q_pos: Tensor) -> Tensor:
        """HACK attention of ``q [n, Hq, D]`` over the layer's rows with ``key_pos <= q_pos``."""
        if q.dim() != 3 or q.shape[2] != self.head_dim or q.shape[1] % self.num_kv_heads:
            raise HackCacheError(
                f"q must be [n, Hq, {self.head_dim}] with Hq a multiple of {self.num_kv_heads}, got {tuple(q.shape)}"
            )
        if q_pos.dim() != 1 or q_pos.numel() != q.shape[0]:
            raise HackCacheError(f"q_pos must be [n={q.shape[0]}], got {tuple(q_pos.shape)}")
        view = self.layer_view(layer)
        if not view.num_quant_k and not view.dense_pos.numel():
            raise HackCacheError(f"attend on layer {layer} before any row was written")
        cfg = self.config
        if self._triton_ok(q, q_pos, view, self.windows[layer]):
            from ragkv.attention.hack_triton import hack_decode_view

            out = hack_decode_view(q, view, self.scale, qp_bits=cfg.qp_bits)
        else:
            out = hack_attention(
                view,
                q,
                q_pos.to(self.device),
                self.scale,
                sliding_window=self.windows[layer],
                qp_bits=cfg.qp_bits,
                backend=cfg.backend,
            )
        return out.to(q.dtype)

    def _triton_ok(self, q: Tensor, q_pos: Tensor, view: HackLayerView, window: int | None) -> bool:
        """Single-token CUDA decode that sees every row: the fused kernel's case."""
        if not (self.config.use_triton and q.is_cuda and q.shape[0] == 1 and window is None):
            return False
        from ragkv.attention.hack_triton import triton_supported

        if not triton_supported(view):
            return False
        last = max(
            int(view.k_pos.max()) if view.num_quant_k else -1,
            int(view.dense_pos.max()) if view.dense_pos.numel() else -1,
        )
        return int(q_pos[0]) >= last

    @property
    def length(self) -> int:
        return self._layers[-1].rows

    def breakdown(self) -> dict[str, int]:
        """Bytes per component, summed over layers (codes, scales_mins, sums, fp16_rows, smooth_stats)."""
        total: dict[str, int] = {}
        for st in self._layers:
            for key, val in st.nbytes().items():
                total[key] = total.get(key, 0) + val
        return total

    def nbytes(self) -> int:
        """Exact bytes of stored KV: codes + scales + mins + sums + fp16 tail/sink/window rows + stats.

        Positions are bookkeeping shared with the dense cache and not counted by either.
        """
        return sum(self.breakdown().values())

    def settings(self) -> dict:
        """The configuration as a plain dict (for logs and benchmark output)."""
        return asdict(self.config)
