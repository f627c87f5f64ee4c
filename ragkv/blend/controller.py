"""Loading controller (CacheBlend §5.1): pick the recompute ratio that loading can hide.

Profiled once per (model, device): the per-layer time of a full prefill at a few lengths, and each
store's per-layer load throughput (read + checksum + decode, bytes of KV per second). Then, per
request, ``r = max(r_match, r_min)`` with ``r_match = T_load_layer / T_prefill_layer(N)`` (recompute
of r% of a layer costs ~r% of that layer's prefill), and the cheapest store that hides loading at a
given ratio can be recommended. Decisions carry their numbers and a reason, and are logged.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ragkv.kv.chunk import ChunkKV
from ragkv.model.gguf import write_json_atomic

log = logging.getLogger("ragkv.blend")


@dataclass
class Decision:
    """One ratio choice with the estimates behind it."""

    ratio: float
    r_match: float
    r_min: float
    t_load_layer_s: float
    t_prefill_layer_s: float
    store: str
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadingController:
    """Estimators profiled offline; see the module docstring."""

    prefill_layer_s: dict[int, float]  # prompt length -> seconds per layer of a full prefill
    load_bytes_per_s: dict[str, float]  # store name -> bytes of KV restored per second
    kv_bytes_per_token_layer: int  # K+V bytes of one token in one layer (model dtype)
    r_min: float = 0.15
    decisions: list[Decision] = field(default_factory=list, repr=False)

    # ---- estimators ----------------------------------------------------------------------------
    def t_prefill_layer(self, n_tokens: int) -> float:
        """Per-layer prefill time at ``n_tokens``, least-squares fit of a*n + b*n^2 over the profile."""
        pts = sorted(self.prefill_layer_s.items())
        if not pts:
            raise ValueError("controller has no prefill profile")
        if len(pts) == 1:
            n0, t0 = pts[0]
            return t0 * n_tokens / n0
        a11 = sum(n * n for n, _ in pts)
        a12 = sum(n**3 for n, _ in pts)
        a22 = sum(n**4 for n, _ in pts)
        b1 = sum(n * t for n, t in pts)
        b2 = sum(n * n * t for n, t in pts)
        det = a11 * a22 - a12 * a12
        a = (b1 * a22 - b2 * a12) / det
        b = (a11 * b2 - a12 * b1) / det
        return max(a * n_tokens + b * n_tokens * n_tokens, 1e-9)

    def t_load_layer(self, n_cached_tokens: int, store: str) -> float:
        if store not in self.load_bytes_per_s:
            raise KeyError(f"store {store!r} was not profiled; known: {sorted(self.load_bytes_per_s)}")
        return n_cached_tokens * self.kv_bytes_per_token_layer / self.load_bytes_per_s[store]

    # ---- decisions -----------------------------------------------------------------------------
    def choose_ratio(self, n_tokens: int, n_cached_tokens: int, store: str) -> Decision:
        """Mode 1: the store is fixed; recompute as much as loading hides, at least ``r_min``."""
        t_load = self.t_load_layer(n_cached_tokens, store)
        t_pre = self.t_prefill_layer(n_tokens)
        r_match = min(1.0, t_load / t_pre)
        ratio = max(r_match, self.r_min)
        if r_match > self.r_min:
            reason = (
                f"loading a layer from {store} ({t_load * 1e3:.2f} ms) outlasts recomputing "
                f"{self.r_min:.0%} of it; recomputing {ratio:.0%} is hidden behind the load"
            )
        else:
            reason = (
                f"loading a layer from {store} ({t_load * 1e3:.2f} ms) is faster than recomputing "
                f"{self.r_min:.0%} ({self.r_min * t_pre * 1e3:.2f} ms): the quality floor r_min applies"
            )
        d = Decision(round(ratio, 4), round(r_match, 4), self.r_min, t_load, t_pre, store, reason)
        self.decisions.append(d)
        log.info("loading controller: ratio %.3f (%s)", d.ratio, reason)
        return d

    def recommend_store(
        self, n_tokens: int, n_cached_tokens: int, costs: dict[str, float], ratio: float | None = None
    ) -> str | None:
        """Mode 2: the ratio is fixed; the cheapest store (by ``costs``) whose load hides behind it."""
        ratio = self.r_min if ratio is None else ratio
        budget = ratio * self.t_prefill_layer(n_tokens)
        ok = [
            s for s in costs if s in self.load_bytes_per_s and self.t_load_layer(n_cached_tokens, s) <= budget
        ]
        choice = min(ok, key=lambda s: costs[s]) if ok else None
        log.info("loading controller: cheapest store hiding loads at ratio %.2f: %s", ratio, choice)
        return choice

    # ---- profiling -----------------------------------------------------------------------------
    @classmethod
    def profile(
        cls,
        model,
        stores: dict | None = None,
        lengths: tuple[int, ...] = (256, 1024, 2048),
        probe_tokens: int = 512,
        r_min: float = 0.15,
        cache_path: str | os.PathLike | None = None,
        runs: int = 2,
    ) -> LoadingController:
        """Measure prefill and store load speed on this machine (cached per model and device)."""
        c = model.config
        per_tok = 2 * c.num_kv_heads * c.head_dim * torch.empty((), dtype=model.dtype).element_size()
        cache = Path(cache_path) if cache_path else None
        ident = f"{model.fingerprint}|{model.device}|threads={torch.get_num_threads()}"
        saved = _read_cache(cache).get(ident, {}) if cache else {}
        prefill = {int(k): v for k, v in saved.get("prefill", {}).items()}
        lengths = tuple(min(n, c.max_position) for n in lengths)
        for n in lengths:
            if n in prefill:
                continue
            ids = torch.randint(3, c.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
            model.forward(ids)  # warm-up
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                model.forward(ids)
                times.append(time.perf_counter() - t0)
            prefill[n] = statistics.median(times) / c.num_layers
        loads = dict(saved.get("load", {}))
        for name, store in (stores or {}).items():
            if name not in loads:
                loads[name] = _profile_store(model, store, min(probe_tokens, c.max_position), runs)
        if cache:
            data = _read_cache(cache)
            data[ident] = {"prefill": prefill, "load": loads}
            write_json_atomic(cache, data, indent=1)
        return cls(prefill, loads, per_tok, r_min)


def _read_cache(path: Path | None) -> dict:
    try:
        return json.loads(path.read_text()) if path else {}
    except (OSError, ValueError):
        return {}


def _profile_store(model, store, n_tokens: int, runs: int) -> float:
    """Bytes of KV per second that ``store`` restores layer by layer (write a probe chunk, read it)."""
    c = model.config
    g = torch.Generator().manual_seed(0)
    shape = (c.num_layers, n_tokens, c.num_kv_heads, c.head_dim)
    probe = ChunkKV(
        token_ids=torch.randint(3, c.vocab_size, (n_tokens,), generator=g),
        k=torch.randn(shape, generator=g).to(model.dtype),
        v=torch.randn(shape, generator=g).to(model.dtype),
        start_pos=1,
        fingerprint=model.fingerprint,
        meta={"probe": True},
    )
    key = probe.key
    if not store.put(probe):
        raise RuntimeError(f"cannot profile {store.describe()}: write failed")
    try:
        hdr = store.header(key)
        groups = (
            [(s.start, s.stop) for s in hdr.segments] if hdr else [(i, i + 1) for i in range(c.num_layers)]
        )
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            for a, b in groups:
                if store.load_layers(key, a, b, model.fingerprint) is None:
                    raise RuntimeError(f"cannot profile {store.describe()}: read failed")
            times.append(time.perf_counter() - t0)
    finally:
        store.delete(key)
    return probe.nbytes() / statistics.median(times)
