"""Exact prefix caching (the ``prefix`` mode's baseline): KV of a prompt head computed in context.

Entries are keyed like vLLM's block hashes: segment ``i``'s key hashes every token up to the end
of segment ``i``, so an entry is valid only after exactly the same head. Each entry stores just its
own segment's rows (pre-RoPE K, V), so nested prefixes share storage.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class PrefixSegment:
    """Cached rows of one segment of a prompt head (pre-RoPE K, V ``[L, n, Hkv, D]``)."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[1])

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class PrefixCache:
    """LRU, byte-bounded map from (model, token head) to that head's last segment KV."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, PrefixSegment] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def segment_keys(fingerprint: str, segments: list[list[int]]) -> list[str]:
        h = hashlib.sha256(f"ragkv-prefix|{fingerprint}|".encode())
        keys = []
        for seg in segments:
            h.update(torch.tensor(seg, dtype=torch.int64).numpy().tobytes())
            h.update(b"|")
            keys.append(h.copy().hexdigest())
        return keys

    def lookup(self, fingerprint: str, segments: list[list[int]]) -> list[PrefixSegment]:
        """The cached KV of the longest leading run of ``segments`` (possibly empty)."""
        found = []
        with self._lock:
            for key in self.segment_keys(fingerprint, segments):
                seg = self._entries.get(key)
                if seg is None:
                    break
                self._entries.move_to_end(key)
                found.append(seg)
        return found

    def insert(
        self, fingerprint: str, segments: list[list[int]], k_pre: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store each segment of a head whose rows ``k_pre, v [L, N>=sum(len), Hkv, D]`` were computed."""
        keys = self.segment_keys(fingerprint, segments)
        start = 0
        with self._lock:
            for key, seg in zip(keys, segments, strict=True):
                stop = start + len(seg)
                if key not in self._entries and seg:
                    entry = PrefixSegment(k_pre[:, start:stop].clone(), v[:, start:stop].clone())
                    self._entries[key] = entry
                    self._bytes += entry.nbytes()
                start = stop
            while self._bytes > self.max_bytes and self._entries:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes()

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes
