"""The forward pass: one layer loop over rows at explicit positions.

:func:`run_layers` is the only place where a token's hidden state goes through the decoder layers.
Its callers differ only in *where K/V go and where attention reads them* (a :class:`LayerKV`), and
in *which rows go on* (an optional row selector, CacheBlend's HKVD):

* full prefill and chunk-KV computation (:meth:`ragkv.model.llama.Model.forward`): :class:`CausalKV`,
  the rows' own K/V, causal;
* several chunks written after one shared head in one pass (:func:`packed_chunk_kv_rows`, a chunk-KV
  writer's training): :class:`PackedKV`;
* generate's decode (:func:`ragkv.generate.decode_step`): a dense or HACK
  :class:`~ragkv.attention.kvcache.KVCache`;
* the static (CUDA-graph) decoder of the GPU benchmark (``eval/static_decode.py``): fixed buffers;
* the engine's batched decode (:func:`ragkv.engine.paged_cache.batched_decode_step`): paged blocks;
* every prefill mode, CacheBlend included (:func:`ragkv.blend.core.selective_prefill`), and the
  vLLM hook's layer replay (``integrations/vllm/ragkv_vllm/rows.py``'s ``blend_rows``): a
  :class:`~ragkv.blend.core.BlendKV` (stored, engine-held and computed rows) whose ``select`` is
  HKVD, both through :func:`ragkv.blend.core.blend_layers`.

The model side is a :class:`LayerModel`: ragkv's own :class:`~ragkv.model.llama.Model`, or the vLLM
adapter in ``integrations/vllm/ragkv_vllm/model_hook.py`` (same primitives over vLLM's modules).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ragkv.attention.buffers import KV_BUFFERS
from ragkv.attention.dense import attention
from ragkv.kv.chunk import ChunkKV


@dataclass(frozen=True)
class LayerConfig:
    """What a layer model's ``config`` provides (ragkv's ``ModelConfig`` has it all): this plain one is
    for layer models that have no ``ModelConfig`` (vLLM's)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bos_token_id: int | None
    #: per layer: its sliding window (None: full causal)
    layer_windows: tuple[int | None, ...]

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full causal)."""
        return self.layer_windows[layer]


@runtime_checkable
class LayerModel(Protocol):
    """A causal LM driven layer by layer on any rows (what :func:`run_layers` needs)."""

    config: Any  # LayerConfig's fields and window()
    device: torch.device
    dtype: torch.dtype
    scale: float

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of ``token_ids [n]``."""

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-RoPE ``q [n,Hq,D]``, ``k [n,Hkv,D]``, ``v [n,Hkv,D]`` of rows ``h``."""

    def rope(self, x: torch.Tensor, positions: torch.Tensor, tables: Any = None) -> torch.Tensor:
        """``x [n,H,D]`` rotated at ``positions [n]`` (``tables``: from :meth:`rope_tables`)."""

    def rope_tables(self, positions: torch.Tensor) -> Any:
        """Precomputed rotation of ``positions`` reused by every layer (None if the model has none)."""

    def attend(
        self, layer: int, q, k, v, q_pos, k_pos, contiguous: bool = False, position_blocks: int = 0
    ) -> torch.Tensor:
        """Attention of ``layer`` (its sliding window) of post-RoPE ``q`` over post-RoPE ``k``, ``v``."""

    def finish_layer(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o-proj + residual + MLP of rows ``h`` given their attention output ``[n,Hq,D]``."""


def decoder(model: LayerModel) -> LayerModel:
    """The layer model a single-token decode step runs (``model.decoder()`` where it has one: ragkv's
    :class:`~ragkv.model.llama.Model` on its decode weights, :meth:`~ragkv.model.llama.Model.decoder`);
    multi-row passes always run ``model`` itself."""
    get = getattr(model, "decoder", None)
    return get() if callable(get) else model


def decode_weights_of(model: LayerModel) -> str:
    """Which weights ``model``'s decode steps run on (``"float32"``, ``"gguf"``): what every answer's
    stats report as ``decode_weights``."""
    return str(getattr(model, "decode_weights", "float32"))


def window_attention(
    model: LayerModel, layer: int, q, k, v, q_pos, k_pos, contiguous: bool = False, position_blocks: int = 0
) -> torch.Tensor:
    """:meth:`LayerModel.attend` of a dense-attention model: ragkv's attention with the layer's window."""
    return attention(
        q,
        k,
        v,
        q_pos,
        k_pos,
        model.scale,
        causal_contiguous=contiguous,
        sliding_window=model.config.window(layer),
        position_blocks=position_blocks,
    )


class LayerKV(Protocol):
    """Where a forward's K/V are written and where its attention reads them, per layer."""

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows ``k`` (post-RoPE), ``v [n, Hkv, D]`` at ``positions [n]`` of ``layer``."""

    def attend(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Attention of post-RoPE ``q [n, Hq, D]`` at ``q_pos`` over what ``layer`` holds."""


#: ``select(layer, positions, k_pre, v, q_pre) -> kept local row indices (sorted) or None (keep all)``
RowSelector = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], "torch.Tensor | None"]
#: ``on_pre_rope(layer, positions, k_pre, v)``: sees each layer's fresh pre-RoPE K and V
PreRopeHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


def run_layers(
    model: LayerModel,
    h: torch.Tensor,
    positions: torch.Tensor,
    kv: LayerKV,
    *,
    select: RowSelector | None = None,
    on_pre_rope: PreRopeHook | None = None,
    last_layer_attention: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``h [n, hidden]`` at ``positions [n]`` through every layer; returns ``(h, positions)``.

    Per layer: Q/K/V of the rows; ``select`` may drop rows (HKVD), after which only the kept rows go
    on; ``on_pre_rope`` sees the kept rows' pre-RoPE K/V; Q and K are rotated at the rows' positions;
    ``kv.write`` stores K/V and ``kv.attend`` gives the attention output; the layer's o-proj and MLP
    finish the rows. ``last_layer_attention=False`` stops after the last layer's K/V are written
    (callers that need the KV, not the hidden states); a layer left with no rows only writes K/V.
    """
    L = model.config.num_layers
    tables, tables_of = model.rope_tables(positions), positions
    # one decode row: a model that rotates, writes K/V and attends in one call where the cache allows it
    one_row = positions.numel() == 1 and select is None and on_pre_rope is None and last_layer_attention
    fused_attention = getattr(model, "fused_attention", None) if one_row else None
    for layer in range(L):
        q, k, v = model.qkv(layer, h)
        if fused_attention is not None:
            out = fused_attention(kv, layer, q, k, v, positions, tables)
            if out is not None:
                h = model.finish_layer(layer, h, out)
                continue
        if select is not None:
            keep = select(layer, positions, k, v, q)
            if keep is not None:
                h, q, k, v, positions = h[keep], q[keep], k[keep], v[keep], positions[keep]
        if on_pre_rope is not None:
            on_pre_rope(layer, positions, k, v)
        if tables_of is not positions:  # rows only change where a selector dropped some
            tables, tables_of = model.rope_tables(positions), positions
        q, k = model.rope(q, positions, tables), model.rope(k, positions, tables)
        kv.write(layer, positions, k, v)
        if (layer == L - 1 and not last_layer_attention) or positions.numel() == 0:
            continue  # nothing reads the last layer's output, or no row is left to compute
        h = model.finish_layer(layer, h, kv.attend(layer, q, positions))
    return h, positions


class CausalKV:
    """The rows' own K/V, attended causally: full prefill of a contiguous run of positions."""

    def __init__(self, model: LayerModel):
        self.model = model
        self._kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def write(self, layer, positions, k, v) -> None:
        self._kv = (positions, k, v)

    def attend(self, layer, q, q_pos) -> torch.Tensor:
        pos, k, v = self._kv
        return self.model.attend(layer, q, k, v, q_pos, pos, contiguous=True)


class PackedKV:
    """Several sequences in one pass: rows of segment ``i > 0`` attend to their own segment and to
    segment 0 (a head they share), causally by position. Chunks written after one head in one pass."""

    def __init__(self, model: LayerModel, segments: torch.Tensor):
        self.model, self.segments = model, segments
        self._kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def write(self, layer, positions, k, v) -> None:
        self._kv = (positions, k, v)

    def attend(self, layer, q, q_pos) -> torch.Tensor:
        pos, k, v = self._kv
        seg = self.segments
        return attention(
            q,
            k,
            v,
            q_pos,
            pos,
            self.model.scale,
            sliding_window=self.model.config.window(layer),
            segments=(seg, seg),
        )


class CapturePreRope:
    """``on_pre_rope`` hook keeping rows ``[start:]`` of each layer's pre-RoPE K and V."""

    def __init__(self, start: int = 0):
        self.start = start
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def __call__(self, layer, positions, k, v) -> None:
        self.k.append(k[self.start :])
        self.v.append(v[self.start :])

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_pre, v) [L, n, Hkv, D]``."""
        return torch.stack(self.k), torch.stack(self.v)


def chunk_token_ids(model: LayerModel, token_ids) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(chunk ids, ids to prefill, start)``: the chunk convention prefills a chunk after BOS."""
    ids = torch.as_tensor(list(token_ids) if not torch.is_tensor(token_ids) else token_ids, dtype=torch.long)
    ids = ids.flatten().cpu()
    if ids.numel() == 0:
        raise ValueError("cannot compute KV of an empty chunk")
    bos = model.config.bos_token_id
    start = 1 if bos is not None else 0
    full = torch.cat([torch.tensor([bos]), ids]) if start else ids
    return ids, full, start


def chunk_kv_tensors(
    model: LayerModel, token_ids, context_ids=()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """:func:`chunk_kv_rows` in inference mode (what ingest stores)."""
    with torch.inference_mode():
        return chunk_kv_rows(model, token_ids, context_ids)


def packed_chunk_kv_rows(
    model: LayerModel, chunks: list, context_ids=()
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`chunk_kv_rows` of several chunks in one pass: ``[BOS] + context`` once, then every chunk
    at the positions after it, each seeing the head and itself only (:class:`PackedKV`). The same KV
    as one pass per chunk (up to float rounding), with one layer loop instead of one per chunk: what
    a launch-bound GPU step needs. Returns each chunk's pre-RoPE ``(k, v) [L, n_i, Hkv, D]``."""
    if not chunks:
        return []
    parts = [chunk_token_ids(model, c) for c in chunks]
    _, full0, start = parts[0]
    head = torch.cat([full0[:start], torch.as_tensor(list(context_ids), dtype=torch.long)])
    h_len = int(head.numel())
    ids = torch.cat([head] + [p[0] for p in parts])
    lens = [int(p[0].numel()) for p in parts]
    if hasattr(model, "check_length"):
        model.check_length(h_len + max(lens))
    pos = torch.cat([torch.arange(h_len)] + [torch.arange(h_len, h_len + n) for n in lens])
    seg = torch.cat(
        [torch.zeros(h_len, dtype=torch.long)] + [torch.full((n,), i + 1) for i, n in enumerate(lens)]
    )
    dev = model.device
    cap = CapturePreRope(h_len)
    h = model.embed(ids.to(dev))
    run_layers(
        model, h, pos.to(dev), PackedKV(model, seg.to(dev)), on_pre_rope=cap, last_layer_attention=False
    )
    k, v = cap.stacked()
    return list(zip(k.split(lens, dim=1), v.split(lens, dim=1), strict=True))


def chunk_kv_rows(
    model: LayerModel, token_ids, context_ids=()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A chunk's KV in the chunk convention: ``(ids, k_pre, v, start)`` with ``k_pre, v [L, n, Hkv, D]``.

    Prefills ``[BOS] + ids`` through any layer model (ragkv's or the vLLM adapter) and keeps the
    chunk rows' pre-RoPE K and V; the last layer's attention and MLP are not run (nothing reads them).
    ``context_ids`` (neighbour-conditioned chunk KV, FusionRAG) are prefilled between BOS and the
    chunk; ``start`` is then the chunk's first position after them. Differentiable where autograd is
    on (a chunk-KV writer's training, :mod:`ragkv.adapter.writer`).
    """
    ids, full, start = chunk_token_ids(model, token_ids)
    ctx = torch.as_tensor(list(context_ids), dtype=torch.long)
    if ctx.numel():
        full = torch.cat([full[:start], ctx, full[start:]])
        start += int(ctx.numel())
    if hasattr(model, "check_length"):
        model.check_length(int(full.numel()))
    pos = torch.arange(full.numel(), device=model.device)
    cap = CapturePreRope(start)
    h = model.embed(full.to(model.device))
    run_layers(model, h, pos, CausalKV(model), on_pre_rope=cap, last_layer_attention=False)
    k, v = cap.stacked()
    return ids, k.contiguous(), v.contiguous(), start


#: every exact pass computes at least this many rows (dummy rows appended after the prompt): GEMMs with
#: fewer rows sum in another order on this CPU (measured: 1-3, 5-7 and 9-11 rows differ from the same
#: rows inside a taller product), which would make a short pass's KV differ from full prefill's
EXACT_MIN_ROWS = 16
#: the unit of a thread's share of an elementwise op: PyTorch splits an op of ``numel`` elements
#: into one contiguous chunk per thread, and each chunk ends in a scalar loop where it is not a whole
#: number of vectors; a scalar exp/silu gives other bits than the vector one, so a row whose elements
#: straddle a chunk end in one pass and not in another differs (measured: stories260k's 172-wide MLP
#: at 2 threads). Every pass's row count is a multiple of :func:`exact_row_multiple`.
EXACT_CHUNK_ELEMENTS = 64


def exact_row_multiple(model: LayerModel, threads: int | None = None) -> int:
    """The smallest row count ``R`` (a power of two, at most 64) such that every activation width of
    ``model`` times ``R`` splits into whole :data:`EXACT_CHUNK_ELEMENTS` blocks per thread: with passes
    of a multiple of ``R`` rows no thread's chunk of an elementwise op ends inside a vector. 1 for the
    default model (its widths are multiples of 64)."""
    cfg = model.config
    t = threads or torch.get_num_threads()
    widths = {
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    }
    for r in (1, 2, 4, 8, 16, 32):
        if all((r * w) % (t * EXACT_CHUNK_ELEMENTS) == 0 for w in widths):
            return r
    return 64


class ExactKV:
    """Prompt K/V in one buffer per layer, the first ``first`` rows given (an exact cached prefix), the
    rest written by the pass; attention is split-invariant (:func:`ragkv.attention.exact.exact_attention`)."""

    def __init__(
        self,
        model: LayerModel,
        k: torch.Tensor,
        v: torch.Tensor,
        first: int,
        probe_rows: torch.Tensor | None = None,
    ):
        self.model, self.k, self.v, self.first = model, k, v, first
        #: positions whose attention probabilities are kept per layer (diagnostics: ``probes``)
        self.probe_rows = probe_rows
        self.probes: list[torch.Tensor] = []

    def write(self, layer, positions, k, v) -> None:
        self.k[layer, self.first : self.first + k.shape[0]] = k
        self.v[layer, self.first : self.first + v.shape[0]] = v

    def attend(self, layer, q, q_pos) -> torch.Tensor:
        from ragkv.attention.dense import attention_probs
        from ragkv.attention.exact import exact_attention

        if self.probe_rows is not None:
            end = int(q_pos[-1]) + 1
            self.probes.append(
                attention_probs(
                    q[self.probe_rows - self.first],
                    self.k[layer, :end],
                    self.probe_rows,
                    torch.arange(end, device=q.device),
                    self.model.scale,
                    self.model.config.window(layer),
                )
            )
        return exact_attention(q, self.k[layer], self.v[layer], self.first, self.model.scale)


@dataclass
class ExactPass:
    """What an exact pass returns: the last row's logits and the whole prompt's K/V ``[L, n, Hkv, D]``
    (post-RoPE), the first ``first`` rows as given."""

    logits: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    first: int
    #: per layer, the probe rows' attention probabilities ``[P, Hq, n]`` (None: no probes asked)
    probes: list[torch.Tensor] | None = None


def exact_forward(
    model: LayerModel,
    token_ids,
    cached: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    probe_rows: torch.Tensor | None = None,
    buffers: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> ExactPass:
    """Prefill ``token_ids`` after an exact cached prefix, bit-identical to a pass with nothing cached:
    every row's result depends on its position and the tokens up to it only. ``cached``: post-RoPE
    ``(k, v) [L, n_i, Hkv, D]`` runs of the first ``m`` ids, in order, as earlier exact passes computed
    them (copied once, straight into this pass's buffers).

    Passes shorter than :data:`EXACT_MIN_ROWS`, or not a multiple of :func:`exact_row_multiple` rows, are
    padded with dummy rows after the prompt (causally invisible to it). Sliding-window layers are not split-invariant: callers check
    :func:`exact_supported` first. ``probe_rows``: computed positions whose attention probabilities
    are kept (diagnostics). ``buffers``: ``(k, v, have)``, buffers ``[L, rows, Hkv, D]`` whose first
    ``have`` rows already hold the first rows of ``cached`` (an earlier pass over the same ids, e.g. the
    previous chat turn's): the pass writes into them and copies only the cached rows after ``have``
    (used when they have room for the pass and their last kept row equals ``cached``'s).
    """
    ids = torch.as_tensor(list(token_ids) if not torch.is_tensor(token_ids) else token_ids, dtype=torch.long)
    ids = ids.flatten().cpu()
    n = int(ids.numel())
    m = sum(int(ck.shape[1]) for ck, _ in cached)
    if not 0 <= m < n:
        raise ValueError(f"an exact pass needs at least one row to compute ({m} cached of {n})")
    cfg, dev = model.config, model.device
    if hasattr(model, "check_length"):
        model.check_length(n)
    new = n - m
    total = exact_pass_rows(model, n, m)
    pad = total - n
    run_ids = torch.cat([ids[m:], ids[-1:].repeat(pad)]) if pad else ids[m:]
    shape = (cfg.num_layers, total, cfg.num_kv_heads, cfg.head_dim)
    have = _kept_rows(buffers, cached, shape, m, model.dtype)
    if have:
        k, v = buffers[0][:, :total], buffers[1][:, :total]
    else:
        k = KV_BUFFERS.empty(shape, model.dtype, dev)  # reused memory: no page faults per turn
        v = KV_BUFFERS.empty(shape, model.dtype, dev)
    at = 0
    for ck, cv in cached:
        rows = int(ck.shape[1])
        if at + rows > have:  # the rows not already in place
            skip = max(0, have - at)
            k[:, at + skip : at + rows] = ck[:, skip:]
            v[:, at + skip : at + rows] = cv[:, skip:]
        at += rows
    h = model.embed(run_ids.to(dev))
    positions = torch.arange(m, total, device=dev)
    if probe_rows is not None and bool((probe_rows < m).any() | (probe_rows >= n).any()):
        raise ValueError("probe rows must be computed rows of the prompt")
    kv = ExactKV(model, k, v, m, probe_rows.to(dev) if probe_rows is not None else None)
    h, _ = run_layers(model, h, positions, kv)
    logits = model.logits(h[new - 1 : new])[0].float()
    probes = [p[..., :n] for p in kv.probes] if probe_rows is not None else None
    return ExactPass(logits, k[:, :n], v[:, :n], m, probes)


def exact_pass_rows(model: LayerModel, n: int, m: int) -> int:
    """Rows of the K/V buffers an exact pass over ``n`` ids after ``m`` cached ones fills: the prompt and
    the dummy rows that pad the computed ones (:data:`EXACT_MIN_ROWS`, :func:`exact_row_multiple`)."""
    new = n - m
    unit = exact_row_multiple(model)
    return m + max(EXACT_MIN_ROWS, -(-new // unit) * unit)


def _kept_rows(
    buffers: tuple[torch.Tensor, torch.Tensor, int] | None,
    cached: Sequence[tuple[torch.Tensor, torch.Tensor]],
    shape: tuple[int, ...],
    m: int,
    dtype: torch.dtype,
) -> int:
    """How many leading rows of ``buffers`` a pass of ``shape`` after ``m`` cached rows can keep: 0 when
    none are given, they have no room, or their first or last kept row is not ``cached``'s (a guard
    against a buffer written since it was kept; the rows are an earlier exact pass's, bit-identical to
    the tree's)."""
    if buffers is None:
        return 0
    bk, bv, have = buffers
    have = min(int(have), m)
    fits = bk.shape[1] >= shape[1] and bv.shape[1] >= shape[1] and tuple(bk.shape[2:]) == shape[2:]
    if have <= 0 or not fits or bk.dtype != dtype or bv.dtype != dtype or not cached:
        return 0
    if not (torch.equal(bk[:, 0], cached[0][0][:, 0]) and torch.equal(bv[:, 0], cached[0][1][:, 0])):
        return 0
    at = 0
    for ck, cv in cached:  # the cached run that holds row have - 1
        if at + ck.shape[1] >= have:
            r = have - 1 - at
            same = torch.equal(bk[:, have - 1], ck[:, r]) and torch.equal(bv[:, have - 1], cv[:, r])
            return have if same else 0
        at += int(ck.shape[1])
    return 0


def exact_supported(model: LayerModel) -> bool:
    """Whether :func:`exact_forward` is split-invariant for this model (no sliding-window layer)."""
    return all(model.config.window(i) is None for i in range(model.config.num_layers))


@torch.inference_mode()
def compute_chunk_kv(
    model, token_ids: list[int] | torch.Tensor, fingerprint: str | None = None, context: Sequence[int] = ()
) -> ChunkKV:
    """Prefill ``[BOS] + token_ids`` and return the chunk rows' pre-RoPE K and V.

    ``model`` is any layer model (ragkv's, or the vLLM adapter, which has no fingerprint of its own:
    the caller passes the served checkpoint's ``fingerprint``). ``context``: token ids prefilled
    between BOS and the chunk (a context-primed chunk, issue 38's measurements; not the stored
    convention), cut from the front to fit the model's context.
    """
    if len(context):
        room = model.config.max_position - len(token_ids) - 1
        context = list(context)[-room:] if room > 0 else []
    ids, k, v, start = chunk_kv_tensors(model, token_ids, context)
    fp = model.fingerprint if fingerprint is None else fingerprint
    return ChunkKV(token_ids=ids, k=k, v=v, start_pos=start, fingerprint=fp)
