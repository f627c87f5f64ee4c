"""Layer-wise pipelined loading of stored chunk KV (CacheBlend §5): load layer l+1 while l computes.

``StoredChunk`` is a lazily loaded piece of the prompt: it reads a chunk's KV from a store one
layer group (one blob segment) at a time. ``PipelinedSource`` is a drop-in for
:class:`ragkv.blend.source.LayerSource` that reads, decodes and moves layer ``l+1..l+depth`` to
the device on a background thread (and, on CUDA, a separate stream into pinned buffers) while the
blender recomputes layer ``l``; the blender blocks only on the layer it needs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ragkv.blend.plan import BlendPlan
from ragkv.blend.source import LayerSource, apply_transform
from ragkv.kv.chunk import ChunkKV


class ChunkLoadError(RuntimeError):
    """A stored chunk's layer could not be loaded (miss, corrupt segment, store down) mid-prefill."""

    def __init__(self, key: str, layer: int, index: int | None = None):
        super().__init__(f"KV of chunk {key[:16]} layer {layer} could not be loaded from the store")
        self.key = key
        self.layer = layer
        self.index = index  # position of the chunk among the prompt's chunks, when known


class StoredChunk:
    """A chunk whose KV lives in a :class:`ragkv.store.ChunkStore`, read one layer group at a time."""

    def __init__(
        self, store, key: str, token_ids: list[int], fingerprint: str, header=None, index: int | None = None
    ):
        self.store = store
        self.key = key
        self.token_ids = list(token_ids)
        self.fingerprint = fingerprint
        self.index = index
        self.header = header if header is not None else store.header(key)
        if self.header is None:
            raise ChunkLoadError(key, -1, index)
        if self.header.fingerprint != fingerprint or list(self.header.token_ids) != self.token_ids:
            # never reuse KV of another model or of other text under the same key; content keys name
            # tokens and model, so such a blob is corrupt: let the write-back of the recompute replace it
            getattr(store, "mark_corrupt", lambda k: None)(key)
            raise ChunkLoadError(key, -1, index)
        self._group: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
        self._lock = threading.Lock()
        self.bytes_loaded = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def _segment(self, layer: int) -> tuple[int, int]:
        for seg in self.header.segments:
            if seg.start <= layer < seg.stop:
                return seg.start, seg.stop
        raise ChunkLoadError(self.key, layer, self.index)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            g = self._group
            if g is None or not g[0] <= layer < g[1]:
                start, stop = self._segment(layer)
                out = self.store.load_layers(self.key, start, stop, self.fingerprint)
                if out is None:
                    raise ChunkLoadError(self.key, layer, self.index)
                g = self._group = (start, stop, out[0], out[1])
                self.bytes_loaded += out[0].numel() * out[0].element_size() * 2
            return g[2][layer - g[0]], g[3][layer - g[0]]


class PinnedStaging:
    """A ring of reusable host staging buffers for the layer-by-layer host-to-device copies.

    ``torch.cat`` of pinned tensors returns an *unpinned* tensor, so concatenating the pieces and then
    copying made every "non_blocking" copy synchronous (and pinning each piece per layer costs a
    page-locking allocation per piece per layer). Instead each layer's pieces are written straight into
    one of ``slots`` buffers allocated once (page-locked when CUDA is present) and grown only when a
    layer needs more rows; a buffer is refilled only after the copy that last read it has finished
    (its CUDA event), so ``slots = depth + 1`` lets the loader run ``depth`` layers ahead.
    """

    def __init__(self, slots: int = 2, pin: bool | None = None):
        self.slots = max(1, int(slots))
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._bufs: list[torch.Tensor | None] = [None] * self.slots
        self._events: list = [None] * self.slots
        self._next = 0
        self.allocations = 0  # buffer (re)allocations, for tests and benchmarks

    def stage(self, parts: list[torch.Tensor]) -> tuple[int, torch.Tensor]:
        """Copy ``parts`` (concatenated on dim 0) into the next free buffer: ``(slot, host view)``."""
        slot = self._next
        self._next = (slot + 1) % self.slots
        ev = self._events[slot]
        if ev is not None:  # the copy that last read this buffer must be done before it is overwritten
            ev.synchronize()
            self._events[slot] = None
        rows = sum(int(p.shape[0]) for p in parts)
        tail, dtype = tuple(parts[0].shape[1:]), parts[0].dtype
        buf = self._bufs[slot]
        if buf is None or buf.shape[0] < rows or tuple(buf.shape[1:]) != tail or buf.dtype != dtype:
            cap = max(rows, buf.shape[0] if buf is not None and tuple(buf.shape[1:]) == tail else 0)
            buf = torch.empty((cap, *tail), dtype=dtype, pin_memory=self.pin)
            self._bufs[slot] = buf
            self.allocations += 1
        pos = 0
        for p in parts:
            n = int(p.shape[0])
            buf[pos : pos + n].copy_(p)
            pos += n
        return slot, buf[:rows]

    def release(self, slot: int, event) -> None:
        """Mark ``slot``'s buffer as read by the copy ``event`` completes (None: read synchronously)."""
        self._events[slot] = event

    def buffers(self) -> list[torch.Tensor]:
        """The allocated staging buffers (for tests: pinned when CUDA is present)."""
        return [b for b in self._bufs if b is not None]


class PipelinedSource(LayerSource):
    """Prefetches the next ``depth`` layers on a background thread while the blender computes.

    On CUDA (or with ``staged=True``) each layer's pieces go through :class:`PinnedStaging` buffers
    reused across layers and reach the device by an asynchronous copy on a side stream; the compute
    stream waits for that copy's event and calls ``record_stream`` on the loaded tensors, so the caching
    allocator does not hand their memory to the loader's next layer while a kernel still reads them.
    """

    def __init__(
        self,
        pieces: list,
        device: torch.device | str,
        dtype: torch.dtype,
        depth: int = 1,
        num_layers: int | None = None,
        staged: bool | None = None,
    ):
        super().__init__(pieces, device, dtype)
        self.depth = max(1, depth)
        self.num_layers = num_layers
        # one torch thread in the loader (the setting is per thread): with the compute thread's pool busy,
        # multi-threaded copies there stall for milliseconds each (measured by the store benchmark)
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="ragkv-kv-load",
            initializer=torch.set_num_threads,
            initargs=(1,),
        )
        self._futures: dict[int, Future] = {}
        dev = torch.device(device)
        self._stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        self.staged = (dev.type == "cuda") if staged is None else bool(staged)
        # K and V of a layer each take a slot; depth layers ahead plus the one being copied
        self.staging = (
            PinnedStaging(slots=2 * (self.depth + 1), pin=dev.type == "cuda") if self.staged else None
        )
        self.load_s = 0.0
        self._submit(0)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A fresh device tensor holding ``host`` (asynchronous from pinned memory), in the source dtype."""
        out = torch.empty(host.shape, dtype=self.dtype, device=self.device)
        if host.dtype == self.dtype:
            out.copy_(host, non_blocking=True)
            return out
        # copy in the stored dtype, convert on the device: a cross-device copy_ that also converts
        # would first convert on the host, into unpinned memory
        raw = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        raw.copy_(host, non_blocking=True)
        out.copy_(raw)
        return out

    def _load(self, layer: int):
        """Layer ``layer`` read, moved and transformed on the loader thread: ``(out, transform used)``."""
        t0 = time.perf_counter()
        fn = self.transform  # read once: the caller checks it against the one set when it takes the layer
        ks, vs = zip(*(p.layer_kv(layer) for p in self.pieces), strict=True) if self.staged else ((), ())
        if not self.staged:
            out = self._read(layer, fn)
        elif any(x.device.type != "cpu" for x in (*ks, *vs)):  # pieces already on the device: no staging
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                out = apply_transform(
                    fn, layer, *(torch.cat(x).to(self.device, self.dtype) for x in (ks, vs))
                )
                if self._stream is not None:
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    out = (*out, event)
        else:
            sk, hk = self.staging.stage(ks)
            sv, hv = self.staging.stage(vs)
            if self._stream is None:  # staged on the CPU (tests): synchronous copies
                out = apply_transform(fn, layer, self._to_device(hk), self._to_device(hv))
                self.staging.release(sk, None)
                self.staging.release(sv, None)
            else:
                with torch.cuda.stream(self._stream):  # the transform's kernels run on the loader's stream
                    out = apply_transform(fn, layer, self._to_device(hk), self._to_device(hv))
                    event = torch.cuda.Event()
                    event.record(self._stream)
                self.staging.release(sk, event)
                self.staging.release(sv, event)
                out = (*out, event)
        self.load_s += time.perf_counter() - t0
        return out, fn

    def _submit(self, layer: int) -> None:
        if layer in self._futures or (self.num_layers is not None and layer >= self.num_layers):
            return
        self._futures[layer] = self._pool.submit(self._load, layer)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._submit(layer)
        for ahead in range(1, self.depth + 1):
            self._submit(layer + ahead)
        t0 = time.perf_counter()
        try:
            out, used = self._futures.pop(layer).result()
            if used is not self.transform:
                # read ahead before the transform was set (layer 0 is submitted when the source is
                # built, and a KV adapter is set on it after): read it again, on the loader thread
                out, used = self._pool.submit(self._load, layer).result()
        finally:
            self.wait_s += time.perf_counter() - t0
        if len(out) == 3:  # CUDA: the compute stream waits for the copy, then owns the tensors
            compute = torch.cuda.current_stream(out[0].device)
            compute.wait_event(out[2])
            out = out[:2]
            for t in out:
                # allocated on the loader's stream: without this the allocator may give their memory to
                # the next layer's load while this layer's kernels are still reading it
                t.record_stream(compute)
        return out

    def close(self) -> None:
        for f in self._futures.values():
            f.cancel()
        self._futures.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


def pipelined_factory(model, depth: int = 1):
    """A ``source_factory`` for :func:`ragkv.blend.prefill` that pipelines loading with recompute."""

    def make(pieces: list) -> PipelinedSource:
        return PipelinedSource(pieces, model.device, model.dtype, depth, model.config.num_layers)

    return make


def prefill_with_recovery(
    model,
    prefix,
    items: list,
    suffix,
    plan: BlendPlan,
    recompute: Callable[[list[int]], ChunkKV],
    on_load_error: Callable[[ChunkLoadError], None] | None = None,
    **prefill_kw,
):
    """:func:`ragkv.blend.prefill` of ``plan`` that never uses KV it could not read: a chunk whose
    stored KV fails to load mid-way (corrupt segment, store down) is replaced in ``items`` by
    ``recompute(its tokens)`` and the prefill is retried; each chunk fails at most once, so this ends."""
    from ragkv.blend.prefill import prefill

    args = plan.prefill_args()
    for _ in range(len(items) + 1):
        try:
            return prefill(model, prefix, items, suffix, **args, **prefill_kw)
        except ChunkLoadError as e:
            if on_load_error is not None:
                on_load_error(e)
            i = (
                e.index
                if e.index is not None
                else next(j for j, it in enumerate(items) if getattr(it, "key", None) == e.key)
            )
            items[i] = recompute(list(items[i].token_ids))
    raise RuntimeError("could not load or recompute the chunks' KV")
