"""Large K/V buffers kept for reuse: an exact pass and a decode cache take one, and the next request gets
the same memory back once nothing holds it.

Why: a follow-up chat turn copies ~110 MB of cached K/V (2,500 tokens of the default model) into its
pass's buffer and again into the decode cache. Fresh buffers of that size come from the kernel as new
pages (glibc maps blocks above 32 MB afresh and unmaps them on free), so each turn paid a page fault per
4 KB: measured 30 ms for the copy against 6 ms into reused pages, on a turn that computes in ~150 ms.
A buffer is free again when no tensor views its storage (its storage's use count).
"""

from __future__ import annotations

import threading

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
        #: buffers handed out again (reused) and allocated (new), for tests and /metrics
        self.reused = 0
        self.allocated = 0

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
        fixed = [s for i, s in enumerate(shape) if i != rows_dim]
        nbytes = torch.empty((), dtype=dtype).element_size()
        for s in shape:
            nbytes *= s
        device = torch.device(device)
        if _use_count is None or nbytes < MIN_POOLED_BYTES or device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        inference = torch.is_inference_mode_enabled()
        with self._lock:
            fits = [
                b
                for b in self._bufs
                if b.is_inference() == inference  # an inference tensor cannot be written outside that mode
                and b.dtype == dtype
                and b.dim() == len(shape)
                and [n for i, n in enumerate(b.shape) if i != rows_dim] == fixed
                and b.shape[rows_dim] >= rows
                and self._free(b)
            ]
            if fits:
                buf = min(fits, key=lambda b: b.shape[rows_dim])
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
