"""The prefill of an assembled prompt ``[prefix] + [chunk_1..chunk_n] + [query suffix]`` in a mode,
without the blending gate: :func:`ragkv.blend.prefill.prefill` (the public entry) runs the gate
first; the gate's own probes (:mod:`ragkv.blend.gate`) run this directly. Modes: see
:mod:`ragkv.blend.prefill`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from ragkv.blend.core import COMPUTED, EXACT, REUSED, BlendSchedule, PrefillResult, selective_prefill
from ragkv.blend.exact import exact_prefill
from ragkv.blend.kvtree import KVTree
from ragkv.blend.source import ChunkKVAdapter, LayerSource
from ragkv.defaults import DEFAULT_MODE, MODES, Mode
from ragkv.kv.chunk import ChunkKV
from ragkv.model.forward import exact_supported

log = logging.getLogger("ragkv.blend")


class UnknownModeError(ValueError):
    """A prefill mode other than full, prefix, reuse or blend."""


def _tokens(item) -> list[int]:
    if isinstance(item, ChunkKV):
        return item.token_ids.tolist()
    if hasattr(item, "token_ids") and hasattr(item, "layer_kv"):
        ids = item.token_ids
        return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return [int(t) for t in item]


def _has_kv(item) -> bool:
    return (
        item is not None and not isinstance(item, (list, tuple, torch.Tensor)) and hasattr(item, "layer_kv")
    )


def assemble(
    model,
    prefix_ids: Sequence[int],
    chunks: Sequence,
    suffix_ids: Sequence[int],
    mode: str = DEFAULT_MODE,
    *,
    schedule: BlendSchedule | None = None,
    prefix_cache: KVTree | None = None,
    source_factory: Callable[[list], LayerSource] | None = None,
    probe_suffix: bool = False,
    prefix_cache_insert: bool = True,
    preselected: Sequence[int] | None = None,
    offset_oracle: Callable | None = None,
    adapter: ChunkKVAdapter | None = None,
) -> PrefillResult:
    """Prefill the assembled prompt in ``mode`` (no gate: see :func:`ragkv.blend.prefill.prefill`);
    ``blend`` runs ``schedule`` (None: the default one).

    ``chunks`` items are :class:`ChunkKV` (stored KV available), plain token-id lists (no stored
    KV: computed), or any object with ``token_ids``, ``num_tokens`` and ``layer_kv(l)`` (a store
    reference whose layers are loaded lazily). ``source_factory(pieces)`` builds the per-layer KV
    source (default: sequential; ``ragkv.blend.pipeline.PipelinedSource`` overlaps loading).
    ``adapter``: a :class:`~ragkv.blend.source.ChunkKVAdapter` through which every REUSED chunk's
    stored KV is read; the exact head's rows and the rows the blend recomputes never see it. Stored KV
    must carry ``adapter.kv_fingerprint(model)``: a chunk-KV writer's KV is its own and read as stored.
    ``preselected`` (prompt rows) and ``offset_oracle``: diagnostics of
    :func:`ragkv.blend.core.selective_prefill` (blend mode only).
    """
    if mode not in MODES:
        raise UnknownModeError(f"unknown prefill mode {mode!r}; use one of {MODES}")
    t0 = time.perf_counter()
    cfg = model.config
    fallback = None
    if Mode(mode).reuses and model.blend_ok is False:
        fallback = "model failed the blending self-check; using full prefill"
        log.warning("%s (%s)", fallback, model.name)
        mode = "full"
    # stored KV is the model's own, or a chunk-KV writer's when the adapter is one (its fingerprint)
    kv_fp = model.fingerprint if adapter is None else adapter.kv_fingerprint(model)
    for c in chunks:
        if isinstance(c, ChunkKV):
            c.check_compatible(kv_fp, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    prefix_ids = [int(t) for t in prefix_ids]
    suffix_ids = [int(t) for t in suffix_ids]
    chunk_ids = [_tokens(c) for c in chunks]
    if any(len(c) == 0 for c in chunk_ids):
        raise ValueError("empty chunk in the prompt")
    segments = ([prefix_ids] if prefix_ids else []) + chunk_ids
    all_ids = [t for seg in segments for t in seg] + suffix_ids
    if not all_ids:
        raise ValueError("empty prompt: no prefix, chunks or question")
    model.check_length(len(all_ids))

    probe = None
    if probe_suffix and suffix_ids:
        probe = torch.arange(len(all_ids) - len(suffix_ids), len(all_ids))
    exact_ok = exact_supported(model)
    if mode in ("full", "prefix") and exact_ok:
        # the exact modes: the KV tree's longest cached prefix (``prefix``; ``full`` reuses nothing),
        # the rest computed split-invariantly, nodes ending at the prefix's and each chunk's end
        ends, pos = [], 0
        for seg in segments:
            pos += len(seg)
            ends.append(pos)
        res = exact_prefill(
            model,
            all_ids,
            prefix_cache if mode == "prefix" else None,
            boundaries=ends,
            probe_rows=probe,
            insert=prefix_cache_insert,
        )
        res.stats.update(
            mode=mode,
            ratio=1.0 if mode == "full" else 0.0,
            num_chunks=len(chunks),
            num_head_segments_cached=sum(e <= res.stats["cached_tokens"] for e in ends),
            fallback=fallback,
            adapter=None,
            t_total_s=time.perf_counter() - t0,
        )
        return res

    # segment objects in prompt order: the prefix (no stored chunk KV) then the chunks
    seg_items = ([None] if prefix_ids else []) + list(chunks)
    head: list = []
    if mode in ("reuse", "blend") and prefix_cache is not None and prefix_ids and exact_ok:
        # the instruction prefix's exact rows from the tree (computed and inserted first if missing)
        match = prefix_cache.match(model, prefix_ids)
        try:
            if match.tokens < len(prefix_ids):
                prefix_cache.release(match)
                exact_prefill(model, prefix_ids, prefix_cache, insert=prefix_cache_insert)
                match = prefix_cache.match(model, prefix_ids)
            if match.tokens == len(prefix_ids):
                head = [match.piece(model)]
        finally:
            prefix_cache.release(match)
    n_head_cached = len(head)
    classes: list[int] = []
    pieces: list = list(head)
    for i, (item, seg) in enumerate(zip(seg_items, segments, strict=True)):
        if i < n_head_cached:
            classes += [EXACT] * len(seg)
        elif mode in ("reuse", "blend") and _has_kv(item):
            classes += [REUSED] * len(seg)
            pieces.append(item)
        else:
            classes += [COMPUTED] * len(seg)
    classes += [COMPUTED] * len(suffix_ids)
    assert len(classes) == len(all_ids)

    if mode == "blend":
        schedule = schedule or BlendSchedule()  # the default schedule (its ratio: DEFAULT_RATIO)
    else:
        schedule = None
    source = None
    if pieces:
        source = (source_factory or (lambda p: LayerSource(p, model.device, model.dtype)))(pieces)
        if adapter is not None and len(pieces) > n_head_cached:  # the reused rows follow the exact head
            source = adapter.wrap_source(source, sum(len(s) for s in segments[:n_head_cached]))
    ids = torch.tensor(all_ids, dtype=torch.long)
    res = selective_prefill(
        model,
        ids,
        torch.tensor(classes),
        source,
        schedule,
        probe_rows=probe,
        preselected=torch.as_tensor(list(preselected), dtype=torch.long) if preselected is not None else None,
        offset_oracle=offset_oracle,
    )
    res.stats.update(
        mode=mode,
        ratio=schedule.target_ratio if schedule else (1.0 if mode == "full" else 0.0),
        num_chunks=len(chunks),
        num_head_segments_cached=n_head_cached,
        fallback=fallback,
        adapter=adapter.identity if adapter is not None and mode in ("reuse", "blend") else None,
        t_total_s=time.perf_counter() - t0,
    )
    return res
