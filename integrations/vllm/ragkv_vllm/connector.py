"""``RagkvConnector``: a vLLM ``KVConnectorBase_V1`` that blends stored chunk KV into vLLM's paged cache.

Use (no vLLM patch; the plugin also registers the name ``RagkvConnector`` with vLLM's factory)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "RagkvConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "ragkv_vllm.connector",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "file:///var/lib/ragkv/kv"}}'

A request names its chunks in ``kv_transfer_params`` (see :mod:`ragkv.remote.wire`). Per request:

* **Scheduler** (``get_num_new_matched_tokens``): reads the chunks' store headers (no tensor data),
  finds each chunk's rows in the prompt, plans rows ``[num_local, end)`` (``end`` = the last stored
  chunk's end, never the last prompt row) and reports ``end - num_local`` tokens as loaded
  synchronously. vLLM's own prefix-cache hit (``num_local``) is kept as exact KV.
* **Worker** (``start_load_kv``, before the forward): loads the chunks' KV layer by layer from the
  store (prefetching the next layer on a thread), runs CacheBlend's HKVD selective recompute over
  the vLLM model's layers (:mod:`ragkv_vllm.model_hook`), RoPE-rotates stored pre-RoPE K at
  its new positions and writes every layer's K/V into the request's blocks. vLLM then computes the
  rest of the prompt (the question) over that cache as usual.
* **Misses**: a chunk absent from the store is computed in the blend like any uncached text, and
  (``save``, default on) its KV is computed alone in the chunk convention and stored after the step
  (``wait_for_save``), so the next request reuses it. KV is not copied out of vLLM's cache: that
  KV depends on the prompt around the chunk and is post-RoPE, i.e. not the chunk convention.
* **Load failures** (a header was found but a layer could not be read): with
  ``kv_load_failure_policy="recompute"`` the chunk is recomputed inside the blend; with ``"fail"``
  its blocks are reported through ``get_block_ids_with_load_errors`` and vLLM fails the request.
  If blending cannot run at all in the worker (no model hook, unsupported model or cache layout),
  every claimed block is reported, so vLLM recomputes (or fails) instead of using unwritten KV.

Limits: one KV-cache group (standard decoder-only attention), tensor/pipeline parallel size 1,
cache layouts whose per-layer view is ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``
(FlashAttention and Triton attention backends) or the HACK backend's uint8 pages (blended rows are
written through ``ragkv.attention.hack_paged.write_rows``), Llama / Mistral / Qwen2. Experimental.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ragkv.blend.pipeline import ChunkLoadError, PipelinedSource, StoredChunk
from ragkv.blend.resolver import PieceSlice
from ragkv.blend.spans import ChunkSpan, SpanError, plan_spans
from ragkv.kv.chunk import chunk_key
from ragkv.model.forward import compute_chunk_kv
from ragkv.remote.wire import BlendParams, KVParamsError
from ragkv_vllm.rows import RowPlan, blend_rows, blocks_of_rows, plan_rows, slot_mapping

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.ragkv")  # under vLLM's logger: shown in its log at INFO


class ConnectorConfigError(ValueError):
    """``kv_connector_extra_config`` is missing or malformed."""


@dataclass
class _HackCache:
    """A layer's KV cache in the HACK backend's paged layout and its V tail pool."""

    cache: torch.Tensor
    tails: Any


class UnsupportedCacheLayoutError(ValueError):
    """vLLM's per-layer KV cache is not ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``."""


# ---- metadata (scheduler -> worker; pickled by vLLM) --------------------------------------------
@dataclass
class LoadSpec:
    """Fill rows ``[num_exact, num_rows)`` of a request's blocks with blended chunk KV."""

    req_id: str
    token_ids: list[int]  # the whole prompt
    block_ids: list[int]
    num_exact: int
    spans: list[tuple[int, str, int, int]]  # (index, key, start, length) of chunks found in the store
    mode: str
    ratio: float
    check_layers: list[int]
    deviation: str
    fresh_check_kv: bool = False

    def params(self) -> BlendParams:
        return BlendParams(
            (),
            self.mode,
            self.ratio,
            tuple(self.check_layers),
            self.deviation,
            fresh_check_kv=self.fresh_check_kv,
        )

    def plan(self) -> RowPlan | None:
        spans = [ChunkSpan(i, k, s, n) for i, k, s, n in self.spans]
        return plan_rows(len(self.token_ids), spans, self.num_exact)


@dataclass
class SaveSpec:
    """Chunks (token ids) whose KV was missing: compute alone and store."""

    req_id: str
    chunks: list[list[int]]


@dataclass
class RagkvConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Pending:
    """Scheduler-side state of one request between matching and ``build_connector_meta``."""

    request: Any
    params: BlendParams
    spans: list[ChunkSpan]
    plan: RowPlan | None
    to_save: list[list[int]]
    num_local: int
    load: bool = False


# ---- settings --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` of the connector."""

    store: str | dict
    store_options: dict = field(default_factory=dict)
    max_saves_per_step: int = 4
    prefetch_depth: int = 1
    min_reused_tokens: int = 1

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {"store", "store_options", "max_saves_per_step", "prefetch_depth", "min_reused_tokens"}
        unknown = set(extra) - known
        if unknown:
            raise ConnectorConfigError(
                f"unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(known)}"
            )
        if "store" not in extra:
            raise ConnectorConfigError(
                "kv_connector_extra_config needs 'store' (a ragkv store URL such as file:///var/lib/ragkv/kv "
                "or redis://host:6379/0; memory:// is per-process and does not reach the workers)"
            )
        for k in ("max_saves_per_step", "prefetch_depth", "min_reused_tokens"):
            if k in extra and (not isinstance(extra[k], int) or isinstance(extra[k], bool) or extra[k] < 0):
                raise ConnectorConfigError(f"{k} must be a non-negative integer, got {extra[k]!r}")
        if not isinstance(extra.get("store_options", {}), dict):
            raise ConnectorConfigError("store_options must be a dict")
        return cls(**extra)


def _hit_source(store) -> CacheHitSource:
    """vLLM's cache-tier label for hits from this store (metrics only)."""
    url = store.get("url", "") if isinstance(store, dict) else str(store)
    scheme = url.partition("://")[0] if "://" in url else "file"
    if scheme == "memory":
        return CacheHitSource.HOST
    if scheme == "file" or scheme.startswith("tiered+file"):
        return CacheHitSource.DISK
    return CacheHitSource.EXTERNAL_UNSPECIFIED


# ---- the connector ---------------------------------------------------------------------------
class RagkvConnector(KVConnectorBase_V1):
    """Blends ragkv-stored chunk KV into vLLM's paged KV (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        par = vllm_config.parallel_config
        if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
            # HKVD selection is per rank (each rank sees its own heads): ranks would select different
            # rows and their collectives would diverge
            raise ConnectorConfigError(
                "RagkvConnector needs tensor_parallel_size=1 and pipeline_parallel_size=1"
            )
        self._block_size = int(vllm_config.cache_config.block_size)
        self._policy = self._kv_transfer_config.kv_load_failure_policy
        mc = vllm_config.model_config
        self._model_path = mc.model
        self._tokenizer_path = getattr(mc, "tokenizer", None) or mc.model
        self._dtype = mc.dtype
        self._hf_config = mc.hf_config
        self._store = None
        self._cache_hit_source = _hit_source(self.settings.store)
        try:  # fail at startup, not on the first request (hashes the weights once; cached on disk)
            from ragkv_vllm.model_hook import checkpoint_fingerprint

            self._fingerprint = checkpoint_fingerprint(self._model_path, self._dtype, self._tokenizer_path)
        except Exception as e:
            raise ConnectorConfigError(
                f"ragkv cannot fingerprint the served model {self._model_path!r} ({type(e).__name__}: {e}); "
                "it needs a local or hub safetensors checkpoint of a Llama / Mistral / Qwen2 model"
            ) from e
        # scheduler side
        self._pending: dict[str, _Pending] = {}
        # worker side
        self._kv_caches: dict[int, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        self._save_queue: deque[list[int]] = deque()
        self._saved_keys: set[str] = set()
        self.stats: dict[str, float] = {
            "requests_blended": 0,
            "chunks_hit": 0,
            "chunks_missed": 0,
            "chunks_recomputed_on_load_failure": 0,
            "chunks_saved": 0,
            "rows_loaded": 0,
            "rows_recomputed": 0,
            "blend_s": 0.0,
        }

    # -- shared --------------------------------------------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is a future miss, never a lost hand-off."""
        return False

    @property
    def fingerprint(self) -> str:
        """ragkv fingerprint of the served checkpoint and dtype (see ``model_hook.checkpoint_fingerprint``)."""
        return self._fingerprint

    @property
    def store(self):
        if self._store is None:
            from ragkv.store import store_from_url

            self._store = store_from_url(self.settings.store, **self.settings.store_options)
        return self._store

    # -- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        try:
            params = BlendParams.from_kv_transfer_params(request.kv_transfer_params)
        except KVParamsError as e:
            log.error(
                "ragkv: request %s has malformed kv_transfer_params (%s); no KV reused", request.request_id, e
            )
            return 0, False
        if params is None or not params.chunks:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        spans, to_save = self._find_chunks(params, prompt)
        plan = plan_rows(len(prompt), spans, num_computed_tokens) if spans else None
        if plan is not None and plan.num_reused < self.settings.min_reused_tokens:
            plan = None
        self._pending[request.request_id] = _Pending(
            request, params, spans, plan, to_save if params.save else [], num_computed_tokens
        )
        return (plan.num_external if plan is not None else 0), False

    def _find_chunks(self, params: BlendParams, prompt: list[int]) -> tuple[list[ChunkSpan], list[list[int]]]:
        """Chunks of the request found in the prompt and in the store; token ids of the misses
        (ragkv.blend.spans.plan_spans: the one planner; a bad reference is recomputed, not refused)."""
        warn = lambda key, why: log.warning("ragkv: %s; recomputed", why)  # noqa: E731
        plan = plan_spans(prompt, params.chunks, self.store, self.fingerprint, strict=False, on_drop=warn)
        self.stats["chunks_missed"] += len(plan.misses)
        return plan.hits, [prompt[s.start : s.stop] for s in plan.misses]

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        p = self._pending.get(request.request_id)
        if p is None:
            return
        p.load = num_external_tokens > 0 and p.plan is not None
        if p.load and num_external_tokens != p.plan.num_external:
            # the scheduler trimmed the hit (e.g. a local partial block kept): re-plan from what it kept
            num_local = p.plan.num_rows - num_external_tokens
            p.plan = plan_rows(len(request.prompt_token_ids), p.spans, num_local)
            p.num_local = num_local
            p.load = p.plan is not None and p.plan.num_external == num_external_tokens
            if not p.load:
                log.warning(
                    "ragkv: request %s: vLLM asked for %d external tokens, plan disagrees; no KV reused",
                    request.request_id,
                    num_external_tokens,
                )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RagkvConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            p = self._pending.pop(new.req_id, None)
            if p is None:
                continue
            if p.load:
                meta.loads.append(self._load_spec(new.req_id, p, list(new.block_ids[0])))
            if p.to_save:
                meta.saves.append(SaveSpec(new.req_id, p.to_save))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            # a preempted request that is scheduled again comes back here with all its blocks
            if req_id not in cached.resumed_req_ids or req_id not in self._pending:
                continue
            p = self._pending.pop(req_id)
            block_ids = cached.new_block_ids[i]
            if p.load and block_ids is not None:
                meta.loads.append(self._load_spec(req_id, p, list(block_ids[0])))
        self._pending.clear()  # requests matched but not scheduled this step are matched again later
        return meta

    def _load_spec(self, req_id: str, p: _Pending, block_ids: list[int]) -> LoadSpec:
        plan = p.plan
        prompt = list(p.request.prompt_token_ids)
        return LoadSpec(
            req_id=req_id,
            token_ids=prompt,
            block_ids=block_ids,
            num_exact=plan.num_exact,
            spans=[(s.index, s.key, s.start, s.length) for s in p.spans],
            mode=p.params.mode,
            ratio=float(p.params.ratio),
            check_layers=list(p.params.check_layers),
            deviation=p.params.deviation,
            fresh_check_kv=p.params.fresh_check_kv,
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    # -- worker side ----------------------------------------------------------------------------
    def register_model(self, model) -> None:
        """The model, should vLLM hand it to connectors (proposed in vLLM PR #37339; not called by 0.32)."""
        from ragkv_vllm.model_hook import register_model

        register_model(model, self._vllm_config)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.model_executor.models.utils import extract_layer_index

        self._kv_caches = {extract_layer_index(name): t for name, t in kv_caches.items()}

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RagkvConnectorMetadata):
            return
        for spec in meta.loads:
            self._load(spec)
        for s in meta.saves:
            self._save_queue.extend(s.chunks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # start_load_kv blends and writes every layer before the forward starts (layer pipelining
        # happens inside the blend, between store reads and recompute), so nothing to wait for.
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        # Nothing is copied out of vLLM's cache: a chunk's KV there depends on its prompt and is
        # post-RoPE (not the chunk convention). Missed chunks are computed alone in wait_for_save.
        return

    def wait_for_save(self):
        budget = self.settings.max_saves_per_step
        while self._save_queue and budget > 0:
            toks = self._save_queue.popleft()
            budget -= 1
            try:
                self._save_chunk(toks)
            except Exception as e:  # a failed save only means a future miss
                log.warning(
                    "ragkv: could not store KV of a %d-token chunk (%s: %s)", len(toks), type(e).__name__, e
                )

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # -- worker internals ----------------------------------------------------------------------
    def _layer_model(self):
        from ragkv_vllm.model_hook import layer_model, served_bos_and_window

        bos, window = served_bos_and_window(self._hf_config)
        return layer_model(bos, window)

    def _layer_cache(self, layer: int, model) -> torch.Tensor | _HackCache:
        kv = self._kv_caches.get(layer)
        c = model.config
        if kv is not None and kv.dtype == torch.uint8 and kv.dim() == 4:
            return self._hack_cache(kv, c)
        if (
            kv is None
            or kv.dim() != 4
            or kv.shape[1] != c.num_kv_heads
            or kv.shape[3] != 2 * c.head_dim
            or self._block_size % kv.shape[2] != 0
        ):
            raise UnsupportedCacheLayoutError(
                f"layer {layer} KV cache has shape {None if kv is None else tuple(kv.shape)}; ragkv writes "
                f"[num_blocks, {c.num_kv_heads}, kernel_block_size, {2 * c.head_dim}] with kernel_block_size "
                f"dividing {self._block_size} (FlashAttention / Triton attention layouts)"
            )
        return kv

    def _hack_cache(self, kv: torch.Tensor, c) -> _HackCache:
        """A layer cache in the HACK attention backend's paged layout, with its shared V tail pool."""
        try:
            from ragkv_vllm.hack_backend import _k_partition, hack_bits, hack_layer

            bits = hack_bits(self._vllm_config.cache_config.cache_dtype)
            return _HackCache(kv, hack_layer(kv, c.num_kv_heads, c.head_dim, bits, _k_partition()))
        except Exception as e:
            raise UnsupportedCacheLayoutError(
                f"uint8 KV cache {tuple(kv.shape)} is not a HACK cache for this model ({type(e).__name__}: {e})"
            ) from e

    def _load(self, spec: LoadSpec) -> None:
        """Blend one request's rows into its blocks; on failure apply ``kv_load_failure_policy``."""
        plan = spec.plan()
        if plan is None:
            return
        claimed = blocks_of_rows(spec.block_ids, self._block_size, plan.num_exact, plan.num_rows)
        try:
            model = self._layer_model()
            caches = [self._layer_cache(layer, model) for layer in range(model.config.num_layers)]
        except Exception as e:
            log.error(
                "ragkv: cannot blend request %s (%s: %s); its %d loaded blocks are reported as failed",
                spec.req_id,
                type(e).__name__,
                e,
                len(claimed),
            )
            self._load_errors |= claimed
            return
        t0 = time.perf_counter()
        attempts = len(plan.pieces) + 1
        while attempts > 0:
            attempts -= 1
            try:
                stats = self._blend(spec, plan, model, caches)
                break
            except ChunkLoadError as e:
                failed = next((p for p in plan.pieces if p.span.index == e.index), None)
                if failed is None:
                    raise
                if self._policy != "recompute":
                    log.error("ragkv: request %s: %s; kv_load_failure_policy=fail", spec.req_id, e)
                    self._load_errors |= blocks_of_rows(
                        spec.block_ids, self._block_size, failed.start, failed.stop
                    )
                    return
                log.warning("ragkv: request %s: %s; recomputing that chunk", spec.req_id, e)
                self.stats["chunks_recomputed_on_load_failure"] += 1
                plan = plan.without(e.index)
            except Exception as e:  # e.g. out of memory in the blend: never leave claimed rows unwritten
                log.error(
                    "ragkv: blending request %s failed (%s: %s); its %d loaded blocks are reported as failed",
                    spec.req_id,
                    type(e).__name__,
                    e,
                    len(claimed),
                    exc_info=True,
                )
                self._load_errors |= claimed
                return
        else:
            self._load_errors |= claimed
            return
        dt = time.perf_counter() - t0
        log.info(
            "ragkv: request %s: %d rows blended (%d exact, %d from %d stored chunks, %.0f recomputed per "
            "layer) in %.1f ms (%.1f ms waiting for the store)",
            spec.req_id,
            plan.num_external,
            plan.num_exact,
            plan.num_reused,
            len(plan.pieces),
            sum(stats["recomputed_per_layer"]) / max(1, len(stats["recomputed_per_layer"])),
            1e3 * dt,
            1e3 * stats["t_load_wait_s"],
        )
        self.stats["requests_blended"] += 1
        self.stats["chunks_hit"] += len(plan.pieces)
        self.stats["rows_loaded"] += plan.num_external
        self.stats["rows_recomputed"] += sum(stats["recomputed_per_layer"]) / max(
            1, len(stats["recomputed_per_layer"])
        )
        self.stats["blend_s"] += dt

    def _blend(self, spec: LoadSpec, plan: RowPlan, model, caches: list[torch.Tensor]) -> dict:
        bs = self._block_size
        if isinstance(caches[0], _HackCache):
            return self._blend_hack(spec, plan, model, caches)
        kbs = int(caches[0].shape[2])  # kernel block size: vLLM may split a block into kernel blocks
        D = model.config.head_dim
        source = self._source(spec, plan, model)
        exact_slots = slot_mapping(spec.block_ids, bs, torch.arange(plan.num_exact))
        out_slots = slot_mapping(spec.block_ids, bs, torch.arange(plan.num_exact, plan.num_rows))
        # block b's kernel blocks are b * (bs // kbs) + i, so a slot's kernel block is slot // kbs
        eb, eo = (exact_slots // kbs).to(model.device), (exact_slots % kbs).to(model.device)
        ob, oo = (out_slots // kbs).to(model.device), (out_slots % kbs).to(model.device)

        def exact_kv(layer: int):
            kv = caches[layer][eb, :, eo]  # [n, Hkv, 2D]
            return kv[..., :D], kv[..., D:]

        def write(layer: int, rows, k, v):
            kv = caches[layer]
            kv[ob, :, oo] = torch.cat([k, v], dim=-1).to(kv.dtype)

        ids = torch.tensor(spec.token_ids, dtype=torch.long)
        return blend_rows(model, ids, plan, source, exact_kv, spec.params(), write)

    def _source(self, spec: LoadSpec, plan: RowPlan, model) -> PipelinedSource | None:
        """The stored chunks' KV, layer by layer (prefetched on a thread)."""
        pieces = []
        for p in plan.pieces:
            s = p.span
            toks = spec.token_ids[s.start : s.stop]
            stored = StoredChunk(self.store, s.key, toks, self.fingerprint, index=s.index)
            pieces.append(PieceSlice(stored, p.src_start, p.src_start + p.num_tokens))
        if not pieces:
            return None
        return PipelinedSource(
            pieces, model.device, model.dtype, self.settings.prefetch_depth, model.config.num_layers
        )

    def _blend_hack(self, spec: LoadSpec, plan: RowPlan, model, caches: list[_HackCache]) -> dict:
        """The blend over HACK pages: exact rows read back dequantized, blended rows quantized on write.

        Rows are written through :func:`ragkv.attention.hack_paged.write_rows` (K quantized at once, V
        through the block's fp16 tail, sealed when the block fills), exactly as the attention backend
        writes vLLM's own rows, so the HACK decode that follows reads blended and computed rows alike.
        """
        from ragkv.attention.hack_paged import read_rows, write_rows

        bs = self._block_size
        source = self._source(spec, plan, model)
        exact_slots = slot_mapping(spec.block_ids, bs, torch.arange(plan.num_exact)).to(model.device)
        out_slots = slot_mapping(spec.block_ids, bs, torch.arange(plan.num_exact, plan.num_rows)).to(
            model.device
        )

        def exact_kv(layer: int):
            k, v = read_rows(caches[layer].cache, caches[layer].tails, exact_slots)
            return k.to(model.dtype), v.to(model.dtype)

        def write(layer: int, rows, k, v):
            write_rows(caches[layer].cache, caches[layer].tails, out_slots, k, v)

        ids = torch.tensor(spec.token_ids, dtype=torch.long)
        return blend_rows(model, ids, plan, source, exact_kv, spec.params(), write)

    def _save_chunk(self, toks: list[int]) -> None:
        key = chunk_key(toks, self.fingerprint)
        if key in self._saved_keys or self.store.contains(key):
            self._saved_keys.add(key)
            return
        model = self._layer_model()
        ck = compute_chunk_kv(model, toks, self.fingerprint).to("cpu")
        if self.store.put(ck):
            self._saved_keys.add(key)
            self.stats["chunks_saved"] += 1


__all__ = [
    "ConnectorConfigError",
    "ConnectorSettings",
    "LoadSpec",
    "RagkvConnector",
    "RagkvConnectorMetadata",
    "SaveSpec",
    "SpanError",
    "UnsupportedCacheLayoutError",
]
