"""Large K/V buffers kept for reuse: an exact pass and a decode cache take one, and the next request gets
the same memory back once nothing holds it.

Why: a follow-up chat turn copies ~110 MB of cached K/V (2,500 tokens of the default model) into its
pass's buffer and again into the decode cache. Fresh buffers of that size come from the kernel as new
pages (glibc maps blocks above 32 MB afresh and unmaps them on free), so each turn paid a page fault per
4 KB: measured 30 ms for the copy against 6 ms into reused pages, on a turn that computes in ~150 ms.
A buffer is free again when no tensor views its storage (its storage's use count).

A free buffer may also keep what it holds for its next user: :meth:`BufferPool.keep` tags it (e.g. an
exact pass's K/V for some ids), ``empty`` hands tagged buffers out last, and :meth:`BufferPool.claim`
finds one again by its tag, so that a chat's next turn appends to the rows already in place instead of
copying its whole cached prefix (~170 MB for 3,700 tokens) into a fresh pass buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

#: buffers smaller than this are allocated as usual (the C allocator keeps them in its heap anyway)
MIN_POOLED_BYTES = 8 << 20
#: pooled buffers have room for a multiple of this many rows, so a prompt that grew by a turn fits
ROW_QUANTUM = 512

_use_count = getattr(torch._C, "_storage_Use_Count", None)


class BufferPool:
    """Reusable ``[L, rows, H, D]`` buffers within ``max_bytes``; free ones beyond it are dropped
    (oldest first). ``empty`` returns a view of exactly the asked shape."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._bufs: list[torch.Tensor] = []
        self._lock = threading.Lock()
        #: ``id(buffer) -> (tag, role)`` of free buffers that keep their contents (:meth:`keep`)
        self._tags: dict[int, tuple[object, str]] = {}
        #: buffers handed out again (reused) and allocated (new), and of the reused ones those found
        #: by their contents (:meth:`claim`), for tests and /metrics
        self.reused = 0
        self.allocated = 0
        self.claimed = 0

    @staticmethod
    def _free(buf: torch.Tensor) -> bool:
        # the pool's tensor and the temporary storage object asked are the only users
        return _use_count(buf.untyped_storage()._cdata) <= 2

    def empty(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        rows_dim: int = 1,
    ) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` (its dim ``rows_dim`` the rows: 1 for ``[L, rows, H, D]``,
        2 for a head-major ``[L, H, rows, D]``), from a free pooled buffer when one fits (the smallest),
        else from a new one with room for a multiple of :data:`ROW_QUANTUM` rows."""
        rows = shape[rows_dim]
        nbytes = torch.empty((), dtype=dtype).element_size()
        for s in shape:
            nbytes *= s
        device = torch.device(device)
        if _use_count is None or nbytes < MIN_POOLED_BYTES or device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        inference = torch.is_inference_mode_enabled()
        with self._lock:
            fits = self._fitting(shape, dtype, rows_dim, inference)
            if fits:
                # the smallest that fits, a buffer that keeps nothing before one that keeps a tag's rows
                buf = min(fits, key=lambda b: (id(b) in self._tags, b.shape[rows_dim]))
                self._tags.pop(id(buf), None)
                self._drop(buf)
                self._bufs.append(buf)  # most recently used last
                self.reused += 1
                return buf.narrow(rows_dim, 0, rows)
            big = list(shape)
            big[rows_dim] = -(-rows // ROW_QUANTUM) * ROW_QUANTUM
            buf = torch.empty(big, dtype=dtype, device=device)
            self._bufs.append(buf)
            self.allocated += 1
            self._trim()
            return buf.narrow(rows_dim, 0, rows)

    def _fitting(
        self, shape: tuple[int, ...], dtype: torch.dtype, rows_dim: int, inference: bool
    ) -> list[torch.Tensor]:
        """Free buffers (caller holds the lock) that can hold ``shape``."""
        fixed = [s for i, s in enumerate(shape) if i != rows_dim]
        return [
            b
            for b in self._bufs
            if b.is_inference() == inference  # an inference tensor cannot be written outside that mode
            and b.dtype == dtype
            and b.dim() == len(shape)
            and [n for i, n in enumerate(b.shape) if i != rows_dim] == fixed
            and b.shape[rows_dim] >= shape[rows_dim]
            and self._free(b)
        ]

    def whole(self, view: torch.Tensor) -> torch.Tensor | None:
        """The pooled buffer ``view`` lies in (all its rows), or None when it is not pooled memory."""
        ptr = view.untyped_storage().data_ptr()
        with self._lock:
            return next((b for b in self._bufs if b.untyped_storage().data_ptr() == ptr), None)

    def keep(self, views: Mapping[str, torch.Tensor], tag: object) -> None:
        """Tag the pooled buffers under ``views`` (``role -> view``) as holding ``tag``'s contents: once
        free they are handed out by :meth:`empty` last, and :meth:`claim` finds them by ``tag``. The
        caller vouches that the contents stay what ``tag`` says while anyone views them (nothing writes
        into a tagged buffer but its next claimer)."""
        with self._lock:
            for role, view in views.items():
                ptr = view.untyped_storage().data_ptr()
                buf = next((b for b in self._bufs if b.untyped_storage().data_ptr() == ptr), None)
                if buf is not None:
                    self._tags[id(buf)] = (tag, role)

    def claim(
        self,
        score: Callable[[object], int],
        shapes: Mapping[str, tuple[int, ...]],
        dtype: torch.dtype,
        rows_dim: int = 1,
    ) -> tuple[object, dict[str, torch.Tensor]] | None:
        """The free buffers of one tag (one per role of ``shapes``, each with room for its shape) whose
        tag ``score``s highest above 0, untagged and handed out as views of ``shapes``; None if none."""
        inference = torch.is_inference_mode_enabled()
        with self._lock:
            groups: dict[int, tuple[object, dict[str, torch.Tensor]]] = {}
            for role, shape in shapes.items():
                for b in self._fitting(shape, dtype, rows_dim, inference):
                    tagged = self._tags.get(id(b))
                    if tagged is not None and tagged[1] == role:
                        groups.setdefault(id(tagged[0]), (tagged[0], {}))[1][role] = b
            best, best_score = None, 0
            for tag, bufs in groups.values():
                if len(bufs) == len(shapes):
                    sc = score(tag)
                    if sc > best_score:
                        best, best_score = (tag, bufs), sc
            if best is None:
                return None
            tag, bufs = best
            for b in bufs.values():
                self._tags.pop(id(b), None)
                self._drop(b)
                self._bufs.append(b)  # most recently used last
            self.reused += len(bufs)
            self.claimed += len(bufs)
            return tag, {role: b.narrow(rows_dim, 0, shapes[role][rows_dim]) for role, b in bufs.items()}

    def _trim(self) -> None:
        total = sum(b.numel() * b.element_size() for b in self._bufs)
        for b in list(self._bufs):
            if total <= self.max_bytes:
                break
            if self._free(b):
                self._drop(b)
                total -= b.numel() * b.element_size()

    def _drop(self, buf: torch.Tensor) -> None:
        # by identity: list.remove would compare tensors elementwise
        self._bufs = [b for b in self._bufs if b is not buf]
        self._tags.pop(id(buf), None)

    def nbytes(self) -> int:
        """Bytes held by the pool (buffers in use and free)."""
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._bufs)

    def clear(self) -> None:
        """Drop every free buffer."""
        with self._lock:
            self._bufs = [b for b in self._bufs if not self._free(b)]


#: the process's pool (exact passes and dense decode caches)
KV_BUFFERS = BufferPool()
