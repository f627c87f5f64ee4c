"""Offline intra-frame tiling search (KVFetcher section 3.2.2), cached per model.

The paper searches the power-of-two ``(head grid, head block)`` tilings once per model, scoring each
by the encoded size of sample KV ("input-agnostic", 1.5 h for a 7B model with NVENC). Here the
score is the total segment size of a few sample layer groups with the caller's codec settings, and
the winner is cached in a small JSON file keyed by model fingerprint and codec settings.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from ragkv.store.codecs.video.codec import VideoCodec
from ragkv.store.codecs.video.layout import Tiling, candidate_tilings

_LOCK = threading.Lock()


def default_cache_path() -> Path:
    """``$RAGKV_CACHE_DIR/video_tilings.json`` (default ``~/.cache/ragkv``)."""
    base = os.environ.get("RAGKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ragkv")
    return Path(base) / "video_tilings.json"


def search_tiling(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    codec: VideoCodec,
    candidates: Sequence[Tiling] | None = None,
) -> list[tuple[Tiling, int]]:
    """Encode every sample group ``(k, v) [G, T, Hkv, D]`` with each candidate; ``[(tiling, bytes)]`` best first."""
    if not samples:
        raise ValueError("tiling search needs at least one sample layer group")
    _, _, h, d = samples[0][0].shape
    cands = list(candidates) if candidates is not None else candidate_tilings(h, d)
    scored = []
    for t in cands:
        c = VideoCodec(**(codec.params() | {"tiling": (t.a, t.b)}), threads=codec.threads)
        scored.append((t, sum(len(c.encode(k, v)) for k, v in samples)))
    return sorted(scored, key=lambda x: (x[1], x[0].a, x[0].b))


def cache_key(fingerprint: str, heads: int, head_dim: int, codec: VideoCodec) -> str:
    p = codec.params()
    return f"{fingerprint}|{heads}x{head_dim}|{p['planes']}|k{p['k_bits']}v{p['v_bits']}|{p['mode']}|s{p['slots']}|{p['order']}"


def cached_tiling(
    fingerprint: str, heads: int, head_dim: int, codec: VideoCodec, path: Path | None = None
) -> Tiling | None:
    """The cached search result for this model and codec settings, if any."""
    path = path or default_cache_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    got = data.get(cache_key(fingerprint, heads, head_dim, codec)) if isinstance(data, dict) else None
    if not (isinstance(got, list) and len(got) == 2):
        return None
    t = Tiling(int(got[0]), int(got[1]))
    return t if t in candidate_tilings(heads, head_dim) else None


def tune_tiling(
    fingerprint: str,
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    codec: VideoCodec,
    path: Path | None = None,
) -> Tiling:
    """Cached tiling for this model, searching (and caching) it on a miss."""
    _, _, h, d = samples[0][0].shape
    hit = cached_tiling(fingerprint, h, d, codec, path)
    if hit is not None:
        return hit
    best = search_tiling(samples, codec)[0][0]
    path = path or default_cache_path()
    with _LOCK:
        try:
            data = json.loads(path.read_text())
            data = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            data = {}
        data[cache_key(fingerprint, h, d, codec)] = [best.a, best.b]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    return best
