"""Paged HACK KV over one uint8 tensor per layer, as a serving engine (vLLM) allocates it.

A layer's cache is ``uint8 [num_blocks, num_kv_heads, block_size, token_bytes]``: vLLM's logical
``[B, H, N, C]`` page with one "state" per token. The ``block_size * token_bytes`` bytes of one
(block, head) are contiguous (layouts ``LBHNC`` / ``BLHNC``) and hold, at fixed byte offsets:

* ``k_scale``, ``k_min``: fp16 ``[block_size, D / Pk]`` (per token, per K partition of Pk channels);
* ``v_scale``, ``v_min``: fp16 ``[D]`` (per channel over the block: HACK's V partition Pi = block size);
* ``k_sum`` ``[block_size, D / Pk]`` and ``v_sum`` ``[D]``: cached code sums (uint8 or int16);
* ``k_packed``, ``v_packed``: uint8 ``[block_size, packed_width(D)]`` (2/4/8-bit codes, per token).

K is quantized per token as soon as its row is written (HACK quantizes every new K immediately).
V of a block is quantized once the block is full ("sealed"); until then the open block's V rows stay
fp16 in a :class:`TailPool` (HACK's requantization elimination). The tail is *not* in every page:
that would cost ``block_size * D * 2`` bytes per head per page and undo most of the saving. The pool
has a bounded number of slots keyed by physical block id:

* writing row 0 of a block (re)starts it: its slot is reset (a freed and reused block never sees the
  previous owner's tail);
* writing the last row seals the block (V quantized into the page) and frees the slot;
* the engine never says when it frees a block, so a block abandoned half full (request finished or
  preempted) keeps its slot until reused. When the pool is full, the least recently written slot not
  written in the current step is recycled; if its block is read again (a request that was not
  scheduled for that long), :class:`HackTailError` says so instead of reading stale rows. Size the
  pool at least at the engine's maximum number of running sequences (vLLM: ``max_num_seqs``).

Byte accounting (2-bit, head_dim 128, Pk 64, block 16): 114 bytes per token per head against 512 for
fp16 K+V, a page ratio of 1824 / 8192 = 0.2227; the per-channel fp16 V scale/min (5 bytes per channel
per 16 tokens) dominate the overhead at small blocks. Block 32: 0.1836; block 64: 0.1641.

Decode runs HACK's homomorphic attention: on CUDA through the Triton kernel
(:func:`ragkv.attention.hack_triton.hack_decode_batch`, addressing the pages in place), elsewhere
through the PyTorch reference (:func:`ragkv.attention.hack_ref.hack_attention`) on per-sequence views
gathered from the pages. Prefill attends fresh rows in fp16 plus dequantized earlier context (see
:func:`prefill_attention` for why this deviates from HACK's quantized prefill).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ragkv.attention.hack_cache import HackConfig, check_key_plans
from ragkv.attention.hack_quant import (
    HackConfigError,
    HackError,
    KeyPlan,
    Quantized,
    check_bits,
    check_kv_rows,
    k_partition_size,
    packed_width,
    parts_width,
    quantize_k_rows,
    quantize_v_partitions,
    sum_dtype,
    unpack_codes,
)
from ragkv.attention.hack_ref import HackLayerView, hack_attention

PAGED_BITS = (2, 4, 8)  # byte-aligned codes: a token's codes never straddle a page row
DEFAULT_K_PARTITION = 64  # K channels per partition (capped at head_dim); >= 32 for the Triton kernel


def paged_key_widths(k_bits: int, parts: int) -> tuple[int, ...]:
    """Byte-aligned K partition widths averaging ``k_bits`` (a page row holds 2/4/8-bit codes):
    3 bits are 4 on the first (highest-energy) half of the partitions and 2 on the rest."""
    if k_bits in PAGED_BITS:
        return (k_bits,) * parts
    if k_bits == 3 and parts % 2 == 0:
        return (4,) * (parts // 2) + (2,) * (parts // 2)
    raise HackPagedError(f"paged K codes cannot average {k_bits} bits over {parts} partition(s)")


def stack_key_plans(
    cfg: HackConfig, plans: Sequence[KeyPlan] | None, lay: PagedLayout, layers: int, device
) -> Tensor | None:
    """A page pool's key channel orders ``[L, Hkv, D]`` (None: keys in model order). The plans are
    checked as a per-sequence cache checks them; pages are shared by every layer, so every plan must
    also have the layout's K widths."""
    check_key_plans(cfg, plans, layers, lay.num_kv_heads, lay.head_dim)
    if plans is None:
        return None
    if any(p.bits != lay.key_bits for p in plans):
        raise HackConfigError(f"the key plans of a page pool must all have the widths {lay.key_bits}")
    return torch.stack([p.order for p in plans]).to(device)


class HackPagedError(HackError):
    """Bad input to the paged HACK layout (shapes, dtypes, slots, cache tensor geometry)."""


class HackTailError(HackPagedError):
    """The fp16 V tail of an open block is missing: the tail pool recycled it, or it was never written."""


@dataclass(frozen=True)
class PagedLayout:
    """Geometry and byte offsets of one (block, head) page region; see the module docstring."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    bits: int = 2
    k_partition: int = DEFAULT_K_PARTITION
    #: code bits per K partition (RoPE-aware keys, channels in a KeyPlan's order; the engine's
    #: pages); None: ``bits`` everywhere (the vLLM pages)
    k_bits: tuple[int, ...] | None = None
    offsets: dict[str, int] = field(init=False, compare=False, repr=False)
    token_bytes: int = field(init=False, compare=False)

    def __post_init__(self):
        check_bits(self.bits)
        if self.bits not in PAGED_BITS:
            raise HackPagedError(f"paged HACK supports {PAGED_BITS}-bit codes, got {self.bits}")
        if self.block_size not in (16, 32, 64, 128):
            raise HackPagedError(
                f"block_size {self.block_size} must be 16, 32, 64 or 128 (it is HACK's V partition)"
            )
        if self.num_kv_heads <= 0:
            raise HackPagedError(f"num_kv_heads must be positive, got {self.num_kv_heads}")
        object.__setattr__(self, "k_partition", k_partition_size(self.head_dim, self.k_partition))
        bs, d, nkp = self.block_size, self.head_dim, self.num_k_parts
        if self.k_bits is not None and (len(self.k_bits) != nkp or not set(self.k_bits) <= set(PAGED_BITS)):
            raise HackPagedError(f"K partition widths {self.k_bits}: need {nkp} of {PAGED_BITS} bits")
        pw = packed_width(d, self.bits)
        ks, vs = self.k_sum_dtype.itemsize, self.v_sum_dtype.itemsize
        # 2-byte fields first, then 1-byte ones: every fp16 / int16 field stays 2-byte aligned
        fields = [("k_scale", bs * nkp * 2), ("k_min", bs * nkp * 2), ("v_scale", d * 2), ("v_min", d * 2)]
        sums = [("k_sum", bs * nkp * ks, ks), ("v_sum", d * vs, vs)]
        fields += [(name, size) for name, size, _ in sorted(sums, key=lambda f: -f[2])]
        fields += [("k_packed", bs * self.k_packed_width), ("v_packed", bs * pw)]
        offsets, at = {}, 0
        for name, size in fields:
            offsets[name] = at
            at += size
        object.__setattr__(self, "offsets", offsets)
        tb = math.ceil(at / bs)
        object.__setattr__(self, "token_bytes", tb + (tb % 2))  # even: fp16 views of the page

    @property
    def num_k_parts(self) -> int:
        return self.head_dim // self.k_partition

    @property
    def packed_width(self) -> int:
        return packed_width(self.head_dim, self.bits)

    @property
    def key_bits(self) -> tuple[int, ...]:
        """Code bits of each K partition."""
        return self.k_bits or (self.bits,) * self.num_k_parts

    @property
    def k_packed_width(self) -> int:
        return parts_width(self.key_bits, self.k_partition)

    @property
    def k_sum_dtype(self) -> torch.dtype:
        return sum_dtype(max(self.key_bits), self.k_partition)

    @property
    def v_sum_dtype(self) -> torch.dtype:
        return sum_dtype(self.bits, self.block_size)

    @property
    def head_bytes(self) -> int:
        """Bytes of one (block, head) region: ``block_size * token_bytes``."""
        return self.block_size * self.token_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer (all heads)."""
        return self.num_kv_heads * self.head_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of a page that hold data (the rest is padding to whole, even token rows)."""
        return self.num_kv_heads * (self.offsets["v_packed"] + self.block_size * self.packed_width)

    @property
    def fp16_page_bytes(self) -> int:
        """Bytes of the same block in fp16 K and V."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * 2

    @property
    def ratio(self) -> float:
        """Page bytes relative to an fp16 K+V page."""
        return self.page_bytes / self.fp16_page_bytes

    def config(self, **overrides) -> HackConfig:
        """The :class:`HackConfig` whose per-sequence cache stores exactly these codes."""
        if self.k_bits is not None:  # its per-sequence equivalent also needs the key plans
            raise HackPagedError("pages with RoPE-aware key widths have no plan-free per-sequence config")
        # a K partition below 16 is head_dim itself (capped); HackConfig caps 128 to it the same way
        kp = self.k_partition if self.k_partition >= 16 else 128
        return HackConfig(bits=self.bits, partition=self.block_size, k_partition=kp, **overrides)

    @classmethod
    def for_config(cls, cfg: HackConfig, block_size: int, num_kv_heads: int, head_dim: int) -> PagedLayout:
        """The pages of ``cfg``: its code bits and K partition, RoPE-aware keys as byte-aligned widths."""
        kp = cfg.k_part(head_dim)
        widths = paged_key_widths(cfg.key_bits, head_dim // kp)
        return cls(block_size, num_kv_heads, head_dim, cfg.bits, kp, None if cfg.uniform_keys else widths)

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of a layer's uint8 cache: ``[num_blocks, num_kv_heads, block_size, token_bytes]``."""
        return (num_blocks, self.num_kv_heads, self.block_size, self.token_bytes)

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> Tensor:
        """A zeroed layer cache (tests and engines that allocate themselves)."""
        return torch.zeros(self.cache_shape(num_blocks), dtype=torch.uint8, device=device)


def page_bytes(
    block_size: int, num_kv_heads: int, head_dim: int, bits: int = 2, k_partition: int = 64
) -> int:
    """Bytes of one paged HACK block of one layer."""
    return PagedLayout(block_size, num_kv_heads, head_dim, bits, k_partition).page_bytes


@dataclass
class PageViews:
    """Typed views of a layer cache's fields (no copies): pools in the Triton kernel's layout."""

    k_packed: Tensor  # uint8 [NB, bs, H, PW]
    k_scale: Tensor  # fp16 [NB, bs, H, nKp]
    k_min: Tensor
    k_sum: Tensor  # uint8 / int16 [NB, bs, H, nKp]
    v_packed: Tensor  # uint8 [NB, bs, H, PW]
    v_scale: Tensor  # fp16 [NB, H, D]
    v_min: Tensor
    v_sum: Tensor  # uint8 / int16 [NB, H, D]


def _head_pages(cache: Tensor, lay: PagedLayout) -> Tensor:
    """Check a layer cache and return it as ``uint8 [NB, H, head_bytes]`` (a view)."""
    if cache.dtype != torch.uint8:
        raise HackPagedError(f"a paged HACK cache is uint8, got {cache.dtype}")
    if cache.dim() == 4:
        want = lay.cache_shape(cache.shape[0])
        if tuple(cache.shape) != want:
            raise HackPagedError(f"cache shape {tuple(cache.shape)} is not {want} for {lay}")
        if cache.stride(3) != 1 or cache.stride(2) != lay.token_bytes:
            raise HackPagedError(
                "the token rows of a (block, head) page must be contiguous (KV cache layout LBHNC or "
                f"BLHNC); got strides {cache.stride()}"
            )
        cache = cache.flatten(2)
    if cache.dim() != 3 or cache.shape[1:] != (lay.num_kv_heads, lay.head_bytes) or cache.stride(2) != 1:
        raise HackPagedError(f"cache shape {tuple(cache.shape)} does not hold pages of {lay}")
    if cache.stride(0) % 2 or cache.stride(1) % 2 or cache.storage_offset() % 2:
        raise HackPagedError("page strides and offset must be even (fp16 fields)")
    return cache


def _field(pages: Tensor, lay: PagedLayout, name: str, dtype: torch.dtype, rows: int, width: int) -> Tensor:
    """``[NB, rows, H, width]`` view (``rows == 0``: ``[NB, H, width]``) of one field of every page."""
    size = dtype.itemsize
    base = pages if size == 1 else pages.view(dtype)
    sb, sh = pages.stride(0) // size, pages.stride(1) // size
    off = pages.storage_offset() // size + lay.offsets[name] // size
    if rows == 0:
        return torch.as_strided(base, (pages.shape[0], lay.num_kv_heads, width), (sb, sh, 1), off)
    return torch.as_strided(base, (pages.shape[0], rows, lay.num_kv_heads, width), (sb, width, sh, 1), off)


def page_views(cache: Tensor, lay: PagedLayout) -> PageViews:
    """Field views of a layer cache ``uint8 [NB, H, bs, token_bytes]`` (or ``[NB, H, head_bytes]``)."""
    pages = _head_pages(cache, lay)
    bs, d, nkp, pw = lay.block_size, lay.head_dim, lay.num_k_parts, lay.packed_width
    return PageViews(
        k_packed=_field(pages, lay, "k_packed", torch.uint8, bs, lay.k_packed_width),
        k_scale=_field(pages, lay, "k_scale", torch.float16, bs, nkp),
        k_min=_field(pages, lay, "k_min", torch.float16, bs, nkp),
        k_sum=_field(pages, lay, "k_sum", lay.k_sum_dtype, bs, nkp),
        v_packed=_field(pages, lay, "v_packed", torch.uint8, bs, pw),
        v_scale=_field(pages, lay, "v_scale", torch.float16, 0, d),
        v_min=_field(pages, lay, "v_min", torch.float16, 0, d),
        v_sum=_field(pages, lay, "v_sum", lay.v_sum_dtype, 0, d),
    )


class TailPool:
    """fp16 V rows of open (not yet full) blocks, in a bounded number of slots keyed by physical block.

    One pool per layer. See the module docstring for the reset / seal / recycle rules.
    """

    def __init__(self, lay: PagedLayout, num_slots: int, device: torch.device | str = "cpu"):
        if num_slots <= 0:
            raise HackPagedError(f"a tail pool needs at least one slot, got {num_slots}")
        self.layout = lay
        self.data = torch.zeros(
            num_slots, lay.block_size, lay.num_kv_heads, lay.head_dim, dtype=torch.float16, device=device
        )
        self.slot_of: dict[int, int] = {}  # physical block -> slot
        self.block_of: list[int | None] = [None] * num_slots
        self.last_write = [-1] * num_slots
        self.step = 0  # bumped by every write_rows call (one per layer per engine step)
        self.recycled: set[int] = set()  # blocks whose open tail was recycled (read -> HackTailError)

    @property
    def num_slots(self) -> int:
        return self.data.shape[0]

    @property
    def in_use(self) -> int:
        return len(self.slot_of)

    def nbytes(self) -> int:
        return self.data.numel() * 2

    def begin(self, continuing: list[int], opening: list[int]) -> dict[int, int]:
        """Slots for one write call: ``continuing`` blocks hold one; ``opening`` blocks (row 0 written,
        still open after the call) get a reset one.

        Checks everything before changing anything: a continued block must hold a slot, and the
        opening blocks must fit in free slots plus slots of blocks not written by this call.
        """
        for blk in continuing:
            self.lookup(blk)
        new = [blk for blk in opening if blk not in self.slot_of]
        touched = set(continuing) | set(opening)
        free = [s for s, blk in enumerate(self.block_of) if blk is None]
        old = sorted(
            (s for s, blk in enumerate(self.block_of) if blk is not None and blk not in touched),
            key=lambda s: self.last_write[s],
        )
        if len(new) > len(free) + len(old):
            raise HackTailError(
                f"{len(new)} blocks stay open after this write but only {len(free) + len(old)} of the "
                f"{self.num_slots} V tail slots are free or recyclable; raise the tail pool size "
                "(at least the maximum number of running sequences)"
            )
        for blk in new:
            slot = free.pop(0) if free else old.pop(0)
            gone = self.block_of[slot]
            if gone is not None:  # least recently written: a block abandoned half full, or a stalled one
                del self.slot_of[gone]
                self.recycled.add(gone)
            self.slot_of[blk] = slot
            self.block_of[slot] = blk
        for blk in opening:
            self.recycled.discard(blk)
            self.data[self.slot_of[blk]].zero_()
        for blk in touched:
            self.last_write[self.slot_of[blk]] = self.step
        return {blk: self.slot_of[blk] for blk in touched}

    def lookup(self, block: int) -> int:
        """The slot holding ``block``'s open tail, or :class:`HackTailError`."""
        slot = self.slot_of.get(block)
        if slot is None:
            why = "was recycled (pool too small)" if block in self.recycled else "was never started (row 0)"
            raise HackTailError(f"the fp16 V tail of open block {block} {why}")
        return slot

    def release(self, block: int) -> None:
        slot = self.slot_of.pop(block, None)
        if slot is not None:
            self.block_of[slot] = None
            self.last_write[slot] = -1

    def slot_tensor(self, blocks: list[int], device: torch.device) -> Tensor:
        """Slots of ``blocks`` (-1 entries: no open block, slot 0 is used as a never-read stand-in)."""
        return torch.tensor(
            [self.lookup(b) if b >= 0 else 0 for b in blocks], dtype=torch.long, device=device
        )


def _check_rows(lay: PagedLayout, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
    check_kv_rows(k, v, lay.num_kv_heads, lay.head_dim, HackPagedError)
    if slot_mapping.dim() != 1 or slot_mapping.numel() < k.shape[0]:
        raise HackPagedError(f"slot_mapping must be [>= {k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
        raise HackPagedError(f"slot_mapping must be integers, got {slot_mapping.dtype}")


def write_rows(cache: Tensor, tails: TailPool, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
    """Write post-RoPE rows ``k, v [n, H, D]`` at slots ``block * block_size + offset`` (-1: skip).

    K is quantized per token now; V goes to the block's fp16 tail, and a block whose last row is written
    is sealed (V quantized per channel over the block). Bad input raises before anything is written.
    """
    lay = tails.layout
    _check_rows(lay, slot_mapping, k, v)
    tails.step += 1
    n = k.shape[0]
    slots = slot_mapping[:n].to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    if not slots.numel():
        return
    views = page_views(cache, lay)
    if int(slots.max()) >= views.k_packed.shape[0] * lay.block_size:
        raise HackPagedError(f"slot {int(slots.max())} is past the cache's {views.k_packed.shape[0]} blocks")
    dev = views.k_packed.device
    slots = slots.to(dev)
    blk, off = slots // lay.block_size, slots % lay.block_size
    blk_cpu, off_cpu = blk.tolist(), off.tolist()
    blocks = list(dict.fromkeys(blk_cpu))  # distinct blocks in first-write order
    starts = {b for b, o in zip(blk_cpu, off_cpu, strict=True) if o == 0}
    ends = {b for b, o in zip(blk_cpu, off_cpu, strict=True) if o == lay.block_size - 1}
    continuing = [b for b in blocks if b not in starts]
    # tail bookkeeping first (it may raise, changing nothing), then the data
    slot_of = tails.begin(continuing, [b for b in blocks if b in starts and b not in ends])
    # rows are rounded to fp16 first, as HackKVCache stores them, so both quantize the same values
    packed, scale, mn, sums = quantize_k_rows(k.to(dev, torch.float16).float(), lay.bits, lay.k_partition)
    views.k_packed[blk, off] = packed
    views.k_scale[blk, off] = scale
    views.k_min[blk, off] = mn
    views.k_sum[blk, off] = sums
    # V: stage every touched block's rows (held tail + new rows), keep the open ones, seal the full ones
    tdev = tails.data.device
    index = {b: i for i, b in enumerate(blocks)}
    stage = torch.zeros(len(blocks), *tails.data.shape[1:], dtype=torch.float16, device=tdev)
    if continuing:
        held = torch.tensor([slot_of[b] for b in continuing], dtype=torch.long, device=tdev)
        stage[torch.tensor([index[b] for b in continuing], device=tdev)] = tails.data[held]
    at = torch.tensor([index[b] for b in blk_cpu], dtype=torch.long, device=tdev)
    stage[at, off.to(tdev)] = v.to(tdev, torch.float16)
    still_open = [b for b in blocks if b not in ends]
    if still_open:
        keep = torch.tensor([slot_of[b] for b in still_open], dtype=torch.long, device=tdev)
        tails.data[keep] = stage[torch.tensor([index[b] for b in still_open], device=tdev)]
    full = [b for b in blocks if b in ends]
    if full:
        rows = stage[torch.tensor([index[b] for b in full], device=tdev)].to(dev).float()
        vp, vs, vm, vsum = quantize_v_partitions(
            rows.reshape(-1, lay.num_kv_heads, lay.head_dim), lay.bits, lay.block_size
        )
        fb = torch.tensor(full, dtype=torch.long, device=dev)
        views.v_packed[fb] = vp.view(len(full), lay.block_size, lay.num_kv_heads, -1)
        views.v_scale[fb] = vs
        views.v_min[fb] = vm
        views.v_sum[fb] = vsum
        for b in full:  # sealed: its slot (or a stale one left by a previous owner) is free again
            tails.release(b)


def _seq_blocks(block_ids: Tensor | list[int], seq_len: int, lay: PagedLayout) -> tuple[list[int], int, int]:
    """(block ids used, full blocks, rows in the open block) of a sequence of ``seq_len`` rows."""
    ids = block_ids.tolist() if isinstance(block_ids, Tensor) else list(block_ids)
    nfull, rem = divmod(seq_len, lay.block_size)
    need = nfull + (1 if rem else 0)
    if len(ids) < need:
        raise HackPagedError(f"{seq_len} rows need {need} blocks, the block table has {len(ids)}")
    return [int(b) for b in ids[:need]], nfull, rem


def sequence_view(cache: Tensor, tails: TailPool, block_ids, seq_len: int) -> HackLayerView:
    """The first ``seq_len`` rows of a sequence as a :class:`HackLayerView` (gathered copies)."""
    lay = tails.layout
    views = page_views(cache, lay)
    blocks, nfull, rem = _seq_blocks(block_ids, seq_len, lay)
    dev = views.k_packed.device
    bt = torch.tensor(blocks, dtype=torch.long, device=dev)
    rows = torch.arange(seq_len, device=dev)
    rb, ro = bt[rows // lay.block_size], rows % lay.block_size
    sealed = bt[:nfull]
    h, d, pw = lay.num_kv_heads, lay.head_dim, lay.packed_width
    if rem:
        tail = tails.data[tails.lookup(blocks[nfull]), :rem].to(dev)
    else:
        tail = torch.empty(0, h, d, dtype=torch.float16, device=dev)
    empty = torch.empty(0, h, d, dtype=torch.float16, device=dev)
    return HackLayerView(
        bits=lay.bits,
        k_part=lay.k_partition,
        v_part=lay.block_size,
        head_dim=d,
        k_packed=views.k_packed[rb, ro],
        k_scale=views.k_scale[rb, ro],
        k_min=views.k_min[rb, ro],
        k_sum=views.k_sum[rb, ro],
        k_pos=rows,
        v_packed=views.v_packed[sealed].reshape(-1, h, pw),
        v_scale=views.v_scale[sealed],
        v_min=views.v_min[sealed],
        v_sum=views.v_sum[sealed],
        v_tail=tail,
        dense_k=empty,
        dense_v=empty,
        dense_pos=torch.empty(0, dtype=torch.long, device=dev),
    )


def read_rows(cache: Tensor, tails: TailPool, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    """Dequantized K and V (fp32 ``[n, H, D]``) of the rows at ``slot_mapping``; open-block V is exact.

    A row of an open block must have been written; a full block must be sealed (every row written).
    """
    lay = tails.layout
    views = page_views(cache, lay)
    dev = views.k_packed.device
    slots = slot_mapping.to(dev, torch.long)
    blk, off = slots // lay.block_size, slots % lay.block_size
    h, d, pk = lay.num_kv_heads, lay.head_dim, lay.k_partition
    codes = unpack_codes(views.k_packed[blk, off], lay.bits, d).view(-1, h, d // pk, pk)
    k = Quantized(codes, views.k_scale[blk, off], views.k_min[blk, off]).dequantize().view(-1, h, d)
    v = torch.empty(slots.numel(), h, d, dtype=torch.float32, device=dev)
    for b in sorted(set(blk.tolist())):
        sel = (blk == b).nonzero().flatten()
        slot = tails.slot_of.get(b)
        if slot is not None:  # open block: fp16 tail rows
            v[sel] = tails.data[slot, off[sel].to(tails.data.device)].to(dev).float()
            continue
        vc = unpack_codes(views.v_packed[b, off[sel]], lay.bits, d).float()  # [m, H, D]
        v[sel] = vc * views.v_scale[b].float() + views.v_min[b].float()
    return k, v


def decode_attention(
    cache: Tensor,
    tails: TailPool,
    q: Tensor,
    block_table: Tensor,
    seq_lens: Tensor | list[int],
    scale: float,
    *,
    use_triton: bool | None = None,
) -> Tensor:
    """HACK attention of one query token per sequence ``q [B, Hq, D]`` over its ``seq_lens[b]`` rows.

    ``use_triton=None`` picks the Triton kernel when it can run on ``q``'s device (CUDA, or CPU under
    ``TRITON_INTERPRET=1``) and supports the geometry; otherwise the reference runs per sequence.
    Returns fp32 ``[B, Hq, D]``.
    """
    lay = tails.layout
    if q.dim() != 3 or q.shape[2] != lay.head_dim or q.shape[1] % lay.num_kv_heads:
        raise HackPagedError(
            f"q must be [B, Hq, {lay.head_dim}] with Hq a multiple of {lay.num_kv_heads}, got {tuple(q.shape)}"
        )
    lens = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, Tensor) else seq_lens)]
    if len(lens) != q.shape[0] or block_table.dim() != 2 or block_table.shape[0] < q.shape[0]:
        raise HackPagedError(
            f"{q.shape[0]} queries need {q.shape[0]} seq_lens and block-table rows, got "
            f"{len(lens)} and {tuple(block_table.shape)}"
        )
    if any(n <= 0 for n in lens):
        raise HackPagedError(f"every sequence needs at least one written row, got seq_lens {lens}")
    if use_triton is None:
        use_triton = _triton_usable(q.device, lay)
    if use_triton:
        return _decode_triton(cache, tails, q, block_table, lens, scale)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        view = sequence_view(cache, tails, block_table[b], n)
        out[b] = hack_attention(view, q[b : b + 1], torch.tensor([n - 1], device=q.device), scale)[0]
    return out


def _triton_usable(device: torch.device, lay: PagedLayout) -> bool:
    from ragkv.attention import hack_triton as ht

    if not ht.triton_runnable(device):
        return False
    probe = HackLayerView(  # geometry only: triton_supported reads bits and partition sizes
        lay.bits, lay.k_partition, lay.block_size, lay.head_dim, *([torch.empty(0)] * 13)
    )
    return ht.triton_supported(probe)


def _decode_triton(cache: Tensor, tails: TailPool, q: Tensor, block_table: Tensor, lens: list[int], scale):
    """The kernel over the pages in place; only the open blocks' fp16 tails are gathered."""
    from ragkv.attention.hack_triton import HackBatch, hack_decode_batch, packed_tensors

    lay = tails.layout
    views = page_views(cache, lay)
    dev = q.device
    bsz, h, d = q.shape[0], lay.num_kv_heads, lay.head_dim
    open_blocks = [
        int(block_table[b, n // lay.block_size]) if n % lay.block_size else -1 for b, n in enumerate(lens)
    ]
    v_tail = tails.data[tails.slot_tensor(open_blocks, tails.data.device)].to(dev)  # [B, bs, H, D]
    batch = HackBatch(
        bits=lay.bits,
        k_part=lay.k_partition,
        v_part=lay.block_size,
        head_dim=d,
        block_table=block_table[:bsz].to(dev, torch.int32).contiguous(),
        tq=torch.tensor(lens, dtype=torch.int32, device=dev),
        **packed_tensors(views),
        v_tail=v_tail,
        dense_k=torch.zeros(bsz, 1, h, d, dtype=torch.float16, device=dev),
        dense_v=torch.zeros(bsz, 1, h, d, dtype=torch.float16, device=dev),
        dense_len=torch.zeros(bsz, dtype=torch.long, device=dev),
        k_shift=None,
        q_mul=None,
    )
    return hack_decode_batch(q, batch, scale)


def prefill_attention(
    cache: Tensor,
    tails: TailPool,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_ids,
    context_len: int,
    scale: float,
) -> Tensor:
    """Causal attention of a prefill chunk ``q [n, Hq, D]`` at positions ``[context_len, context_len + n)``.

    Keys: the sequence's first ``context_len`` rows read back dequantized from the pages (open-block V
    exact from the tail), then the chunk's own rows ``k, v [n, H, D]`` in fp16, causally masked.

    Deviation from HACK: HACK runs prefill homomorphically on quantized Q/K/P/V. Here the fresh rows
    (usually nearly all of the prompt) stay fp16, because the prompt's attention quality sets every
    later token and a prefill is compute-bound, where 2-bit operands save no time on dense GPUs (HACK
    targets disaggregated prefill, where it speeds the transfer, not the prefill math). Only rows
    already in the cache (earlier chunks, prefix-cache hits) are seen quantized, as decode sees them.
    Returns fp32 ``[n, Hq, D]``.
    """
    lay = tails.layout
    n, hq, d = q.shape
    hkv = lay.num_kv_heads
    if k.shape != (n, hkv, d) or v.shape != k.shape or hq % hkv:
        raise HackPagedError(f"prefill q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    dev = q.device
    if context_len:
        blocks, _, _ = _seq_blocks(block_ids, context_len, lay)
        bt = torch.tensor(blocks, dtype=torch.long)
        rows = torch.arange(context_len)
        ck, cv = read_rows(cache, tails, bt[rows // lay.block_size] * lay.block_size + rows % lay.block_size)
        keys = torch.cat([ck.to(dev), k.float()])
        vals = torch.cat([cv.to(dev), v.float()])
    else:
        keys, vals = k.float(), v.float()
    g = hq // hkv
    s = torch.einsum("nhgd,thd->hgnt", q.float().view(n, hkv, g, d), keys) * scale
    qpos = torch.arange(n, device=dev) + context_len
    mask = torch.arange(keys.shape[0], device=dev)[None, :] <= qpos[:, None]
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    o = torch.einsum("hgnt,thd->nhgd", p, vals)
    return o.reshape(n, hq, d)


__all__ = [
    "DEFAULT_K_PARTITION",
    "HackPagedError",
    "HackTailError",
    "PageViews",
    "PagedLayout",
    "TailPool",
    "decode_attention",
    "page_bytes",
    "page_views",
    "prefill_attention",
    "read_rows",
    "sequence_view",
    "write_rows",
]
