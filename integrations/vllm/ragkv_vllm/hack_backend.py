"""HACK 2-bit KV attention backend for vLLM (v1 interfaces of 0.32 / 0.33): ``--attention-backend CUSTOM``.

The plugin registers :class:`HackAttentionBackend` as ``AttentionBackendEnum.CUSTOM``. Each layer's KV
cache is ragkv's paged HACK layout (:mod:`ragkv.attention.hack_paged`): one uint8 page per block with
per-token 2/4/8-bit K codes, per-channel V codes over the block (V partition = block size), fp16
scales/mins and code sums. vLLM allocates exactly that many bytes because :meth:`customize_spec`
publishes the page as ``[num_kv_heads, block_size, token_bytes]`` uint8 (``state_content_bytes``);
this works on 0.32 with ``--kv-cache-dtype auto`` (vLLM then sizes the cache in HACK pages). On 0.33
the plugin also registers the KV-cache dtypes ``hack_2bit`` / ``hack_4bit`` / ``hack_8bit``
(``register_kv_cache_dtype``); with ``auto`` the bit width comes from ``RAGKV_HACK_BITS`` (default 2).

* KV update (``do_kv_cache_update``): post-RoPE K quantized per token at once; V kept fp16 in a
  per-layer tail pool until its block is full, then quantized into the page.
* Decode (query length 1): HACK homomorphic attention; on CUDA the Triton kernel reads the pages in
  place (it needs ``--block-size`` >= 32 and head_dim >= 32; otherwise the PyTorch reference runs).
* Prefill: fresh rows in fp16, earlier context dequantized (a deviation from HACK's quantized prefill,
  explained in :func:`ragkv.attention.hack_paged.prefill_attention`).

Limits: decoder self-attention only, no sliding window, ALiBi, soft cap, attention sinks, KV sharing,
FP8 output quantization, CUDA graphs (``_cudagraph_support = NEVER``) or DCP/PCP. Tail pool size:
``RAGKV_HACK_TAIL_SLOTS`` (default ``2 * max_num_seqs``). Experimental: never run on a GPU here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from ragkv.attention.hack_paged import (
    DEFAULT_K_PARTITION,
    HackPagedError,
    PagedLayout,
    TailPool,
    decode_attention,
    prefill_attention,
    write_rows,
)
from ragkv_vllm.plugin import (
    HACK_KV_CACHE_DTYPES,
)  # one table; the plugin module imports no vLLM

BITS_ENV = "RAGKV_HACK_BITS"
TAIL_SLOTS_ENV = "RAGKV_HACK_TAIL_SLOTS"
K_PARTITION_ENV = "RAGKV_HACK_K_PARTITION"
BLOCK_SIZES = (16, 32, 64, 128)


def hack_bits(kv_cache_dtype: str | None) -> int:
    """Code bits for a ``--kv-cache-dtype``: ``hack_<b>bit``, or ``RAGKV_HACK_BITS`` for auto/fp16/bf16."""
    if kv_cache_dtype in HACK_KV_CACHE_DTYPES:
        return HACK_KV_CACHE_DTYPES[kv_cache_dtype]
    if kv_cache_dtype in (None, "auto", "float16", "bfloat16"):
        raw = os.environ.get(BITS_ENV, "2")
        if raw not in ("2", "4", "8"):
            raise HackPagedError(f"{BITS_ENV} must be 2, 4 or 8, got {raw!r}")
        return int(raw)
    raise HackPagedError(
        f"the HACK backend stores its own quantized KV; kv_cache_dtype {kv_cache_dtype!r} is not one of "
        f"auto, float16, bfloat16, {', '.join(HACK_KV_CACHE_DTYPES)}"
    )


def _k_partition() -> int:
    raw = os.environ.get(K_PARTITION_ENV, str(DEFAULT_K_PARTITION))
    if raw not in ("16", "32", "64", "128"):
        raise HackPagedError(f"{K_PARTITION_ENV} must be 16, 32, 64 or 128, got {raw!r}")
    return int(raw)


def _cache_dtype_str(spec: AttentionSpec) -> str | None:
    """The served ``--kv-cache-dtype`` (the spec only carries a torch dtype)."""
    from vllm.config import get_current_vllm_config_or_none

    vc = get_current_vllm_config_or_none()
    return vc.cache_config.cache_dtype if vc is not None and vc.cache_config is not None else None


def _served_block_size(spec_block_size: int) -> int:
    """The block size a HACK page is laid out for (vLLM asks for a 1-token spec when sizing blocks)."""
    if spec_block_size in BLOCK_SIZES:
        return spec_block_size
    from vllm.config import get_current_vllm_config_or_none

    vc = get_current_vllm_config_or_none()
    bs = vc.cache_config.block_size if vc is not None and vc.cache_config is not None else None
    return bs if bs in BLOCK_SIZES else 16


def paged_layout(
    block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str | None
) -> PagedLayout:
    """The HACK page geometry this backend uses for a layer."""
    return PagedLayout(block_size, num_kv_heads, head_size, hack_bits(cache_dtype_str), _k_partition())


class HackAttentionBackend(AttentionBackend):
    """vLLM attention backend storing KV as paged HACK codes (see the module docstring)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", *HACK_KV_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[HackAttentionImpl]:
        return HackAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[HackMetadataBuilder]:
        return HackMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: KVCacheSpec | None = None) -> list[int | MultipleOf]:
        return list(BLOCK_SIZES)  # a block is one V partition: never split into kernel blocks

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)  # a (block, head) page's rows contiguous

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size > 0 and (head_size <= 16 or head_size % 16 == 0)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in cls.supported_kv_cache_dtypes

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Publish the HACK page: uint8 ``[num_kv_heads, block_size, token_bytes]`` per block.

        vLLM sizes, allocates and views the cache from this (``page_size_bytes``), so the bytes it
        allocates per block are the HACK page, not an fp16 page. Idempotent.
        """
        if spec.state_content_bytes is not None:
            return spec
        if spec.head_size_v != spec.head_size:
            raise HackPagedError("the HACK backend needs head_size_v == head_size")
        lay = paged_layout(
            _served_block_size(spec.block_size), spec.num_kv_heads, spec.head_size, _cache_dtype_str(spec)
        )
        return replace(spec, dtype=torch.uint8, state_content_bytes=lay.token_bytes)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """uint8 shape of one layer's cache (the 4-D view vLLM makes from :meth:`customize_spec`)."""
        return paged_layout(block_size, num_kv_heads, head_size, cache_dtype_str).cache_shape(num_blocks)


@dataclass
class HackMetadata(AttentionMetadata):
    """Per-step metadata; decodes (query length 1) come first in the batch (reorder threshold 1)."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor  # exact (copied from the device once per step)
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int


class HackMetadataBuilder(AttentionMetadataBuilder[HackMetadata]):
    """Builds :class:`HackMetadata` from vLLM's ``CommonAttentionMetadata``."""

    # Tail-pool bookkeeping and the per-request prefill loop run on the host: no CUDA graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        vllm_config,
        device: torch.device,
    ):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> HackMetadata:
        cam = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold or 1
        )
        return HackMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            max_query_len=cam.max_query_len,
            max_seq_len=cam.max_seq_len,
            query_start_loc=cam.query_start_loc,
            seq_lens=cam.seq_lens,
            block_table=cam.block_table_tensor,
            slot_mapping=cam.slot_mapping,
            query_start_loc_cpu=cam.query_start_loc_cpu,
            seq_lens_cpu=cam.seq_lens[: cam.num_reqs].to("cpu"),
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
        )


def _tail_slots() -> int:
    raw = os.environ.get(TAIL_SLOTS_ENV)
    if raw is not None:
        if not raw.isdigit() or int(raw) <= 0:
            raise HackPagedError(f"{TAIL_SLOTS_ENV} must be a positive integer, got {raw!r}")
        return int(raw)
    from vllm.config import get_current_vllm_config_or_none

    vc = get_current_vllm_config_or_none()
    seqs = getattr(getattr(vc, "scheduler_config", None), "max_num_seqs", None) or 256
    return 2 * int(seqs)


_TAIL_POOLS: dict[tuple[int, str], TailPool] = {}  # (cache data_ptr, device) -> the layer's tail pool


def hack_layer(
    kv_cache: torch.Tensor, num_kv_heads: int, head_size: int, bits: int, k_partition: int
) -> TailPool:
    """The tail pool of a layer's HACK cache, shared by the attention impl and the KV connector.

    Keyed by the cache tensor's storage, so whichever writes first (the connector's blend in
    ``start_load_kv`` runs before the first forward) creates it. Raises if the cache is not HACK pages.
    """
    if kv_cache.dim() != 4 or kv_cache.dtype != torch.uint8:
        raise HackPagedError(
            f"expected a uint8 [B, H, N, C] HACK cache, got {kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    lay = PagedLayout(kv_cache.shape[2], num_kv_heads, head_size, bits, k_partition)
    if tuple(kv_cache.shape[1:]) != lay.cache_shape(0)[1:]:
        raise HackPagedError(
            f"the KV cache {tuple(kv_cache.shape)} is not a HACK cache {lay.cache_shape(kv_cache.shape[0])}: "
            "was the spec customized by HackAttentionBackend?"
        )
    key = (kv_cache.data_ptr(), str(kv_cache.device))
    pool = _TAIL_POOLS.get(key)
    if pool is None or pool.layout != lay:
        pool = _TAIL_POOLS[key] = TailPool(lay, _tail_slots(), kv_cache.device)
    return pool


class HackAttentionImpl(AttentionImpl[HackMetadata]):
    """Writes rows into HACK pages and attends over them (decode: homomorphic; prefill: see module)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            "attn_type != decoder": attn_type != AttentionType.DECODER,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name is not None,
        }
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise NotImplementedError(f"the ragkv HACK attention backend does not support {', '.join(bad)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.bits = hack_bits(kv_cache_dtype)
        self.k_partition = _k_partition()
        self.tails: TailPool | None = None

    def _tails_for(self, kv_cache: torch.Tensor) -> TailPool:
        """The layer's tail pool (shared with the KV connector; see :func:`hack_layer`)."""
        if self.tails is None or self.tails.data.device != kv_cache.device:
            self.tails = hack_layer(kv_cache, self.num_kv_heads, self.head_size, self.bits, self.k_partition)
        return self.tails

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write this step's post-RoPE K/V rows (vLLM calls it before ``forward``)."""
        if kv_cache.numel() == 0:
            return
        n = min(key.shape[0], slot_mapping.shape[0])
        write_rows(kv_cache, self._tails_for(kv_cache), slot_mapping[:n], key[:n], value[:n])

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: HackMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the ragkv HACK attention backend does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        tails = self._tails_for(kv_cache)
        md = attn_metadata
        nd = md.num_decode_tokens
        out = output.view(-1, self.num_heads, self.head_size)
        if md.num_decodes:
            o = decode_attention(
                kv_cache,
                tails,
                query[:nd].view(nd, self.num_heads, self.head_size),
                md.block_table[: md.num_decodes],
                md.seq_lens_cpu[: md.num_decodes],
                self.scale,
            )
            out[:nd] = o.to(out.dtype)
        qsl = md.query_start_loc_cpu.tolist()
        for i in range(md.num_decodes, md.num_decodes + md.num_prefills):
            lo, hi = qsl[i], qsl[i + 1]
            ctx = int(md.seq_lens_cpu[i]) - (hi - lo)
            o = prefill_attention(
                kv_cache, tails, query[lo:hi], key[lo:hi], value[lo:hi], md.block_table[i], ctx, self.scale
            )
            out[lo:hi] = o.to(out.dtype)
        return output


__all__ = [
    "HACK_KV_CACHE_DTYPES",
    "HackAttentionBackend",
    "HackAttentionImpl",
    "HackMetadata",
    "HackMetadataBuilder",
    "hack_bits",
    "hack_layer",
    "paged_layout",
]
